"""A model bigger than one device starts under fsdp2 and deepspeed_stage_3 (fabric_utils/pretrained.py): on 2 CPU
processes (DeepSpeed through the test-only shim) no rank holds the model whole when it reaches Fabric's
set-up, its values are the pretrained model's all the same, and every strategy trains to the same numbers. Each run
goes through tests/pretrained_probe.py, which records what each rank saw."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import SMALL_DEMO, run, shimmed

SHARDED = ("fsdp2", "deepspeed_stage_3")
TWO_CPUS = ["--accelerator", "cpu", "--devices", "2", "--precision", "32-true"]
# one epoch of 4 steps of 2 x 16 rows; few rows to evaluate: each run's cost is mostly its processes' start-up
FULL = [*SMALL_DEMO, "--train-size", "128", "--val-size", "16", "--test-size", "16"]
# LoRA at learning rate 0 for 2 steps, with a checkpoint to resume from
LORA = [*FULL, "--lora-r", "4", "--max-steps", "2", "--save-every", "2"]


def probe(root: Path, name: str, strategy: str, flags: list, lr0: bool = False, run_dir: str | None = None) -> dict:
    """Runs train.py with ``flags`` under the probe into ``root/run_dir`` (default: ``name``); its results.json, its
    folder, and each rank's record (in ``root/name-probe``)."""
    out_dir, found = root / (run_dir or name), root / f"{name}-probe"
    env = {"PROBE_OUT": str(found), "PROBE_LR0": "1" if lr0 else "0",
           **shimmed(FABRIC_TEMPLATE_DEEPSPEED_CPU="1")}
    with pytest.MonkeyPatch.context() as patch:
        for variable, value in env.items():
            patch.setenv(variable, value)
        run([sys.executable, "tests/pretrained_probe.py", *TWO_CPUS, "--strategy", strategy, *flags,
             "--out-dir", str(out_dir)])
    return {"results": json.loads((out_dir / "results.json").read_text()), "out_dir": out_dir, "probe": found,
            "ranks": [json.loads((found / f"rank-{rank}.json").read_text()) for rank in range(2)]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """One epoch (4 steps) of full fine-tuning under ddp and each sharded strategy; 2 LoRA steps at learning rate 0
    under each sharded strategy; the fsdp2 LoRA run resumed from its last checkpoint."""
    root = tmp_path_factory.mktemp("pretrained")
    found = {(strategy, "full"): probe(root, f"{strategy}-full", strategy, FULL)
             for strategy in ("ddp", *SHARDED)}
    found.update({(strategy, "lora"): probe(root, f"{strategy}-lora", strategy, LORA, lr0=True)
                  for strategy in SHARDED})
    found["fsdp2", "resumed"] = probe(root, "fsdp2-resumed", "fsdp2", [*LORA, "--resume", "auto"], lr0=True,
                                      run_dir="fsdp2-lora")
    return found


@pytest.mark.parametrize("strategy", SHARDED)
def test_no_rank_holds_the_model_whole_at_set_up(runs, strategy):
    shares = [rank["share"] for rank in runs[strategy, "full"]["ranks"]]
    assert max(shares) <= 0.6, shares
    assert [rank["sources"] for rank in runs[strategy, "full"]["ranks"]] == [1, 0]  # rank 0 alone read the file
    assert [rank["share"] for rank in runs["ddp", "full"]["ranks"]] == [1.0, 1.0]


@pytest.mark.parametrize("strategy", SHARDED)
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_the_sharded_model_computes_the_pretrained_models_logits(runs, strategy, kind):
    ranks = runs[strategy, kind]["ranks"]
    for rank in ranks:
        torch.testing.assert_close(torch.tensor(rank["logits"]), torch.tensor(ranks[0]["source_logits"]))
        assert rank["position_ids"]


@pytest.mark.parametrize("strategy", SHARDED)
def test_every_strategy_trains_to_ddps_validation_loss(runs, strategy):
    ddp, sharded = runs["ddp", "full"]["results"], runs[strategy, "full"]["results"]
    assert sharded["steps"] == ddp["steps"] > 0
    assert sharded["val_loss"] == pytest.approx(ddp["val_loss"], abs=1e-4)


@pytest.mark.parametrize("strategy", SHARDED)
def test_steps_at_learning_rate_0_leave_every_weight_as_loaded(runs, strategy):
    """Under ZeRO-3 values loaded after set-up would look right at first, and the first step would put back the fp32
    master weights DeepSpeed made at set-up from the skeleton."""
    run_ = runs[strategy, "lora"]
    assert run_["results"]["steps"] == 2
    loaded = torch.load(run_["probe"] / "pretrained.pt")
    exported = load_file(run_["out_dir"] / "model" / "model.safetensors")
    assert exported.keys() == loaded.keys()
    for name, weight in loaded.items():
        torch.testing.assert_close(exported[name], weight, rtol=0, atol=0, msg=name)


def test_a_lora_resume_reads_the_pretrained_base_on_rank_0_alone(runs):
    """The checkpoint holds the adapters and the head: the frozen base comes from its source, read once."""
    resumed, first = runs["fsdp2", "resumed"], runs["fsdp2", "lora"]
    assert [rank["sources"] for rank in resumed["ranks"]] == [1, 0]
    assert resumed["results"]["test_loss"] == first["results"]["test_loss"]
    for rank in resumed["ranks"]:  # the checkpoint's values, the non-persistent buffers kept from the skeleton
        torch.testing.assert_close(torch.tensor(rank["logits"]), torch.tensor(first["ranks"][0]["source_logits"]))
        assert rank["position_ids"]


def test_a_weight_tied_across_modules_is_filled_under_each_of_its_names():
    """ZeRO-3's rank-0 fill looks a parameter up by the name its own module gives it: a weight tied across modules
    (T5's and BART's embeddings) has one per module."""
    from fabric_utils.deepspeed_engine import source_values

    model = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4))
    model[1].weight = model[0].weight
    names = {".".join(filter(None, (prefix, name))) for prefix, module in model.named_modules()
             for name, _ in module.named_parameters(recurse=False)}
    assert names == {"0.weight", "1.weight", "1.bias"}
    assert names <= source_values(model).keys()
