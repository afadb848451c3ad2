"""Sharded and mixed-precision paths that used to train silently differently or refuse to start: FSDP1's weight decay
(on 2 CPU processes through the test-only shim in tests/shims/sitecustomize.py), fsdp2's precision under auto and
what its collectives move under bf16-mixed (tests/fsdp2_precision_probe.py), the dtype ZeRO accumulates in,
--compile under DeepSpeed."""

import json
import os
import sys

import pytest
import torch

from conftest import REPO, SHIMS, SMALL_DEMO, build_fabric_from_flags, fake_gpu, run
from fabric_utils import launcher
from fabric_utils.errors import UserError

TWO_CPUS = ["--accelerator", "cpu", "--devices", "2"]


@pytest.fixture(scope="module")
def fsdp1_run(tmp_path_factory):
    """``--strategy fsdp`` (torch's FSDP1) on 2 CPU processes, 2 steps, with a checkpoint at the end."""
    out_dir = tmp_path_factory.mktemp("fsdp1")
    env = {"FABRIC_TEMPLATE_FSDP_CPU": "1", "PYTHONPATH": os.pathsep.join([str(SHIMS), str(REPO)])}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        run([sys.executable, "train.py", *TWO_CPUS, "--strategy", "fsdp", *SMALL_DEMO, "--max-steps", "2",
             "--save-every", "2", "--out-dir", str(out_dir)])
    return out_dir


def test_fsdp1_decays_every_matrix_and_nothing_else(fsdp1_run):
    """FSDP1 hands the optimizer each parameter as a 1-D slice of its unit's flat shard (or an empty one): a rule by
    the shape it sees put every weight in the no-decay group."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    checkpoint = _load_distributed_checkpoint(fsdp1_run / "checkpoints" / "step-000002" / "state")
    groups = {group["weight_decay"]: set(group["params"]) for group in checkpoint["optimizer"]["param_groups"]}
    shapes = {name: weight.shape for name, weight in checkpoint["model"].items()}
    assert groups[0.01] == {name for name, shape in shapes.items() if len(shape) >= 2}
    assert groups[0.0] == {name for name, shape in shapes.items() if len(shape) < 2}
    assert (fsdp1_run / "model" / "model.safetensors").exists()  # consolidated from FSDP1's shards


def test_auto_precision_on_a_gpu_without_bf16_is_one_fsdp2_runs(monkeypatch):
    """fsdp2 (Fabric's ModelParallelStrategy) has no loss scaler and refuses 16-mixed, which auto used to pick on
    GPUs without native bf16 (V100, T4): the default flags did not start there."""
    fake_gpu(monkeypatch, native_bf16=False)
    auto = {"accelerator": "cuda", "devices": "1", "precision": "auto"}
    picked = launcher.resolve_launch_settings({**auto, "strategy": launcher.FSDP2})["precision"]
    assert launcher.resolve_launch_settings({**auto, "strategy": "ddp"})["precision"] == "16-mixed"
    monkeypatch.undo()  # the strategy accepts or refuses a precision whatever the device: check it on this CPU
    launcher.build_fabric(accelerator="cpu", devices="1", strategy=launcher.FSDP2, precision=picked)
    with pytest.raises(UserError, match="does not support"):
        launcher.build_fabric(accelerator="cpu", devices="1", strategy=launcher.FSDP2, precision="16-mixed")


@pytest.mark.gpu
def test_fsdp2_starts_with_the_default_precision_on_this_gpu():
    fabric = build_fabric_from_flags("--accelerator", "cuda", "--devices", "1", "--strategy", "fsdp2")
    native_bf16 = torch.cuda.get_device_capability() >= (8, 0)
    assert fabric.strategy.precision.precision == ("bf16-mixed" if native_bf16 else "32-true")


def test_fsdp2_bf16_mixed_gathers_bf16_weights_and_reduces_fp32_gradients(tmp_path):
    """Without a MixedPrecisionPolicy FSDP2 gathered the fp32 weights, twice the bytes of the bf16 autocast computes
    in. Training still matches one process under the same autocast on the same rows."""
    out = tmp_path / "probe.json"
    run([sys.executable, "tests/fsdp2_precision_probe.py", "bf16-mixed", str(out)])
    found = json.loads(out.read_text())
    assert set(found["gathered"]) == {"torch.bfloat16"} and set(found["reduced"]) == {"torch.float32"}
    assert found["losses"] == pytest.approx(found["reference_losses"], rel=2e-2)


@pytest.mark.parametrize("strategy, precision, accumulates_in", [
    ("deepspeed_stage_2", "bf16-mixed", "fp32"), ("deepspeed_stage_3_offload", "bf16-true", "fp32"),
    ("deepspeed_stage_2", "32-true", None), ("deepspeed_stage_1", "bf16-mixed", None)])
def test_zero_2_and_3_accumulate_bf16_gradients_in_fp32(deepspeed_accepts_cpu, strategy, precision, accumulates_in):
    """DeepSpeed accumulates micro-batch gradients in the weights' dtype unless its config says otherwise: bf16
    gradient shards under --grad-accum rounded the sum at every micro-batch. (ZeRO-1 would swap in DeepSpeed's
    BF16_Optimizer, whose checkpoints zero_to_fp32 cannot export.)"""
    fabric = launcher.build_fabric(accelerator="cpu", devices="2", strategy=strategy, precision=precision)
    assert fabric.strategy.config.get("data_types", {}).get("grad_accum_dtype") == accumulates_in


DEEPSPEED_COMPILE = r"""
import json, sys, torch
from fabric_utils.launcher import build_fabric, end_job
from fabric_utils.optim import build_optimizer
from fabric_utils.sharding import compile_in_engine, prepare_for_setup

fabric = build_fabric(accelerator="cpu", devices="2", strategy="deepspeed_stage_3", precision="32-true")
fabric.launch()
losses = {}
for compiled in (False, True):
    fabric.seed_everything(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    if compiled:  # as train.py's --compile hands it over; the eager backend keeps the test quick
        model = torch.compile(model, backend="eager", dynamic=True)
    model, compile_kwargs = prepare_for_setup(fabric, model)
    model, optimizer = fabric.setup(model, build_optimizer(model, "adamw", lr=1e-2, weight_decay=0.0,
                                                           device=fabric.device))
    compile_in_engine(fabric, compile_kwargs)
    losses[compiled] = []
    for step in range(3):
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().mean()
        fabric.backward(loss, model=model)  # two engines in this process: name the one
        optimizer.step()
        optimizer.zero_grad()
        losses[compiled].append(loss.item())
if fabric.global_rank == 0:
    print(json.dumps({"wrapper": type(model._forward_module).__name__, "engine_compiled": fabric.strategy.model.is_compiled,
                      "same_losses": losses[True] == losses[False]}))
end_job(fabric)
"""


def test_compile_under_deepspeed_goes_through_the_engine(tmp_path):
    """DeepSpeed's route is engine.compile(), which compiles the module inside and leaves the engine's own hooks
    eager; Fabric used to compile the whole engine (18 graph breaks against 14 over 3 ZeRO-3 steps here)."""
    script = tmp_path / "deepspeed_compile.py"  # a file: Lightning's launcher starts rank 1 by running it again
    script.write_text(DEEPSPEED_COMPILE)
    done = run([sys.executable, str(script)], deepspeed_cpu=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"wrapper": "DeepSpeedEngine", "engine_compiled": True, "same_losses": True}
