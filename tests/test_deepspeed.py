"""DeepSpeed ZeRO on 2 CPU processes under the test-only shim (tests/shims/sitecustomize.py): offload, accumulation,
what is reduced when, the compile warm-up, --compile, checkpoints. tests/shims/zero_probe.py runs the loop on tiny
models, one with frozen weights as LoRA leaves them."""

import functools
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam

from conftest import SMALL_DEMO, run
from fabric_utils.launcher import build_fabric
from fabric_utils.optim import build_optimizer
from fabric_utils.strategy import offloads_optimizer

TWO_CPUS = ["--accelerator", "cpu", "--devices", "2"]
COMPILED = "deepspeed_stage_3"  # the strategy whose probe also compiles


@functools.cache
def probe(strategy: str) -> dict:
    """One 2-process run of zero_probe.py per strategy, shared by the tests that read it."""
    out = Path(tempfile.mkdtemp()) / "probe.json"
    compile_too = ["--compile"] if strategy == COMPILED else []
    run([sys.executable, "tests/shims/zero_probe.py", strategy, str(out), *compile_too], deepspeed_cpu=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize("strategy, offloads", [("deepspeed_stage_2", False), ("deepspeed_stage_2_offload", True),
                                                ("deepspeed_stage_3_offload", True), ("ddp", False)])
def test_offload_is_read_from_the_strategy(deepspeed_accepts_cpu, strategy, offloads):
    assert offloads_optimizer(build_fabric(accelerator="cpu", strategy=strategy)) == offloads


@pytest.mark.parametrize("name", ["adamw", "adam"])
def test_offload_optimizer_is_deepspeeds_cpu_adam_with_the_same_update(name):
    """ZeRO-Offload refuses torch optimizers. The first use builds DeepSpeed's CPU Adam op (minutes, then cached)."""
    models = [torch.nn.Linear(4, 3) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    start = models[0].weight.detach().clone()
    torch_opt, cpu_adam = (build_optimizer(m, name=name, lr=0.01, weight_decay=0.1, device=torch.device("cpu"),
                                           cpu_adam=DeepSpeedCPUAdam if offload else None)
                           for m, offload in zip(models, (False, True)))
    assert isinstance(cpu_adam, DeepSpeedCPUAdam) and not isinstance(torch_opt, DeepSpeedCPUAdam)
    assert [g["weight_decay"] for g in cpu_adam.param_groups] == [g["weight_decay"] for g in torch_opt.param_groups]
    for _ in range(3):
        for model, optimizer in zip(models, (torch_opt, cpu_adam)):
            model(torch.ones(2, 4)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    torch.testing.assert_close(models[1].weight, models[0].weight)
    assert not torch.allclose(models[0].weight, start)


def test_zero_1_reduces_once_per_optimizer_step_with_accumulation():
    """Fabric's no_backward_sync tells the engine which backward ends a group: ZeRO-1 reduces only in that one
    (--grad-accum 2 used to crash: managed_gradient_accumulation=False with overlap_comm)."""
    runs = probe("deepspeed_stage_1")["accumulate"]
    reduced = {accum: r["backward"] + r["step"] for accum, r in runs.items()}
    assert reduced["1"] > 0 and reduced["2"] == reduced["1"] and reduced["4"] == reduced["1"]
    assert_same_training(runs)


@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "deepspeed_stage_3"])
def test_zero_2_and_3_reduce_every_micro_batch(strategy):
    """They keep only their shard of the gradients, so each backward reduce-scatters; the shards accumulate."""
    runs = probe(strategy)["accumulate"]
    reduced = {accum: r["backward"] + r["step"] for accum, r in runs.items()}
    assert reduced["1"] > 0 and reduced["2"] == 2 * reduced["1"] and reduced["4"] == 4 * reduced["1"]
    assert_same_training(runs)


def assert_same_training(runs: dict) -> None:
    """The same rows as 1, 2 or 4 micro-batches per step give the same weights, and training moved them."""
    after = {accum: torch.tensor(r["weights_after"]) for accum, r in runs.items()}
    assert not torch.allclose(after["1"], torch.tensor(runs["1"]["weights_before"]))
    torch.testing.assert_close(after["2"], after["1"])
    torch.testing.assert_close(after["4"], after["1"])


@pytest.mark.parametrize("strategy", ["deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"])
def test_compile_warm_up_leaves_the_first_step_alone(strategy):
    """ZeRO-3 used to add the warm-up's gradient into step 1: it sits in its gradient shards, which
    model.zero_grad does not reach."""
    runs = probe(strategy)["warm_up"]
    torch.testing.assert_close(torch.tensor(runs["with_warm_up"]), torch.tensor(runs["without"]), rtol=0, atol=0)


def test_compile_under_deepspeed_goes_through_the_engine():
    """DeepSpeed's route is engine.compile(), which compiles the module inside and leaves the engine's own hooks
    eager; Fabric used to compile the whole engine (18 graph breaks against 14 over 3 ZeRO-3 steps)."""
    assert probe(COMPILED)["compile"] == {"wrapper": "DeepSpeedEngine", "engine_compiled": True, "same_losses": True}


def test_zero_1_export_includes_the_frozen_weights():
    """ZeRO-1 leaves frozen weights out of its shards; export used to miss them (a crash under --lora-r)."""
    found = probe("deepspeed_stage_1")["checkpoints"]
    assert found["missing"] == [] and found["export_matches"]


@pytest.mark.parametrize("strategy", ["deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"])
def test_best_checkpoint_holds_the_weights_without_the_optimizer_moments(strategy):
    """checkpoints/best is rewritten at every improvement: it used to hold Adam's two moments too (4 bytes each per
    trained weight). It still loads back into the engine and exports the trained weights."""
    found = probe(strategy)["checkpoints"]
    assert found["bytes"]["step-000002"] - found["bytes"]["best"] >= 2 * 4 * found["trainable"]
    assert found["reloaded_matches"] and found["export_matches"] and found["missing"] == []


@pytest.mark.parametrize("strategy", ["deepspeed_stage_2_offload", "deepspeed_stage_3_offload"])
def test_offload_trains_saves_and_loads_on_two_cpu_processes(tmp_path, strategy):
    """Each run saves sharded checkpoints and loads the best one back for the test split; stage 2 also accumulates
    and resumes. Evaluating 101 and 201 rows in batches of 50 leaves rank 1 a last batch of its repeated row only,
    whose forward it must still run: under ZeRO-3 every forward gathers the weights from all ranks."""
    flags = [*TWO_CPUS, "--strategy", strategy, "--precision", "bf16-mixed", *SMALL_DEMO, "--eval-batch-size", "50",
             "--save-every", "3", "--out-dir", str(tmp_path)]
    if "stage_2" in strategy:  # best kept, as a crash before the finish would leave it for the resume below
        flags += ["--grad-accum", "2", "--keep-best-checkpoint"]
    first = run([sys.executable, "train.py", *flags, "--max-steps", "5"], deepspeed_cpu=True)
    assert (tmp_path / "checkpoints" / "step-000003" / "state").is_dir()  # sharded: a folder, not one file
    # the first step checkpoint's line states its size, which the engine's write alone knows (it said 0 B when the
    # checkpoint was still being committed in the background)
    said = re.search(r"checkpoint step-000003: ([\d.]+) ([kMG])B, the whole model", first.stdout)
    on_disk = sum(p.stat().st_size for p in (tmp_path / "checkpoints" / "step-000003").rglob("*") if p.is_file())
    assert said and float(said[1]) * {"k": 1e3, "M": 1e6, "G": 1e9}[said[2]] == pytest.approx(on_disk, rel=0.05), \
        first.stdout
    assert (tmp_path / "model" / "model.safetensors").exists()  # consolidated from the shards
    results = json.loads((tmp_path / "results.json").read_text())
    assert (results["val_examples"], results["test_examples"]) == (101, 201)  # every row once, none twice
    if "stage_3" in strategy:
        return
    shutil.rmtree(tmp_path / "model")  # the run cut back to its step-3 checkpoint, its newest
    (tmp_path / "results.json").unlink()
    resumed = run([sys.executable, "train.py", *flags, "--max-steps", "5", "--resume", "auto"], deepspeed_cpu=True)
    assert "resumed from" in resumed.stdout and "step 3" in resumed.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["steps"] == 5 and results["world_size"] == 2 and results["strategy"] == "DeepSpeedStrategy"
