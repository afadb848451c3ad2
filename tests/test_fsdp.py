"""``--strategy fsdp2`` (PyTorch's fully_shard through Fabric's ModelParallelStrategy) on two CPU processes: it trains,
writes sharded checkpoints, survives ``kill -9`` and ``--resume auto`` continues exactly (metrics and learning rate),
and the export loads with ``from_pretrained``. Plus the resume of stateful objects on a sharded checkpoint.

The uninterrupted and the killed run start together, as in test_resilience.py, to keep the module near a minute and
a half on two cores."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, Job, kill_all, logged, resumed_step, subprocess_env
from test_resilience import EXPORT_CHECK, TINY

# TINY on half its rows: two epochs of 25 steps of 16 rows, as 8 rows on each of two processes. 65 test rows in
# batches of 32 leave rank 1 a last batch of its repeated row only, which it must still run forward (the blocks'
# all-gathers are collectives)
FSDP2 = ["--devices", "2", "--strategy", "fsdp2", "--train-size", "400", "--batch-size", "8", "--test-size", "65",
         "--eval-batch-size", "32"]
MAX_STEPS = 50
COMPARED = ("val_loss", "val_acc", "test_loss", "test_acc")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted fsdp2 run and one whose rank 0 is killed after its step-20 checkpoint (rank 1 must end by
    itself), then resumed with --resume auto. The killed run also recomputes the blocks' activations in backward,
    which must not change a number either."""
    root = tmp_path_factory.mktemp("fsdp2")
    jobs = {"full": Job(root / "full", *TINY, *FSDP2),
            "killed": Job(root / "killed", *TINY, *FSDP2, "--grad-checkpointing")}
    try:
        jobs["killed"].kill_after("step-000020", rank=0)
        jobs["resumed"] = Job(root / "killed", *TINY, *FSDP2, "--grad-checkpointing", "--resume", "auto")
        yield jobs
    finally:
        kill_all(jobs)


def test_fsdp2_kill_then_resume_matches_uninterrupted(runs):
    full, resumed = runs["full"].results(), runs["resumed"].results()
    step = resumed_step(runs["resumed"].output())
    assert 20 <= step < MAX_STEPS
    assert full["strategy"] == resumed["strategy"] == "ModelParallelStrategy"
    assert full["world_size"] == 2 and resumed["steps"] == full["steps"] == MAX_STEPS
    assert (full["val_examples"], full["test_examples"]) == (48, 65)  # every row once, none twice
    state = runs["full"].out_dir / "checkpoints" / f"step-{MAX_STEPS:06d}" / "state"
    assert state.is_dir() and len(list(state.glob("*.distcp"))) == 2, "not a sharded checkpoint"
    for key in COMPARED:
        assert resumed[key] == pytest.approx(full[key], abs=1e-4), key
    # the schedule went on where it stopped, not from its warm-up
    full_lr, resumed_lr = logged(runs["full"].out_dir, "lr"), logged(runs["resumed"].out_dir, "lr")
    after = [s for s in full_lr if s > step]
    assert after and [resumed_lr[s] for s in after] == pytest.approx([full_lr[s] for s in after], rel=1e-6)


def test_fsdp2_export_loads_with_from_pretrained(runs):
    full = runs["full"].results()
    model_dir = runs["full"].out_dir / "model"
    data_file = Path.home() / ".cache" / "fabric-template" / "demo" / "data" / "test.parquet"
    done = subprocess.run([sys.executable, "-c", EXPORT_CHECK, str(model_dir), str(data_file), "65"], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["id2label"] == {"0": "negative", "1": "positive"}
    # the consolidated weights are the trained ones: they score what the run scored (one row of slack for padding)
    assert abs(found["acc"] - full["test_acc"]) <= 1 / 65 + 1e-6, (found, full["test_acc"])


SCHEDULE_RESUME = r"""
import json, sys
from pathlib import Path
import torch
from fabric_utils.checkpoint import save_checkpoint
from fabric_utils.resume import load_checkpoint
from fabric_utils.launcher import build_fabric

class Tiny(torch.nn.Sequential):
    _no_split_modules = ["Linear"]

fabric = build_fabric(accelerator="cpu", devices="1", strategy="fsdp2", precision="32-true")
fabric.launch()

def build():
    model = fabric.setup_module(Tiny(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)))
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, fabric.setup_optimizers(plain), torch.optim.lr_scheduler.StepLR(plain, 1, gamma=0.5)

model, optimizer, scheduler = build()
for _ in range(3):
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 3}
save_checkpoint(fabric, Path(sys.argv[1]), "step-000003", state)

model, optimizer, scheduler = build()  # a new run
state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
load_checkpoint(fabric, Path(sys.argv[1]) / "step-000003", state)
print(json.dumps({"same_object": state["scheduler"] is scheduler, "last_epoch": scheduler.last_epoch,
                  "lr": optimizer.param_groups[0]["lr"], "step": state["step"]}))
"""


def test_sharded_resume_restores_the_scheduler_in_place(tmp_path):
    """A sharded checkpoint gives back the scheduler's state_dict instead of restoring it; load_checkpoint must load
    it into the live scheduler, or the schedule starts over on resume."""
    done = subprocess.run([sys.executable, "-c", SCHEDULE_RESUME, str(tmp_path)], cwd=REPO,
                          env={**subprocess_env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "step-000003" / "state").is_dir()  # sharded
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"same_object": True, "last_epoch": 3, "lr": pytest.approx(0.1 * 0.5 ** 3), "step": 3}
