"""A run resumes on another number of devices (a requeued job may come back with fewer) and continues the
same optimization: the same rows in each optimizer step (accumulation makes up for the missing devices), the same
schedule and steps, the epoch continued at the same row. DDP's one-file checkpoints and FSDP2's distributed ones load
on any number of processes; DeepSpeed's shards are refused with one line.

Dropout is off: each rank draws its own masks, so masks cannot follow the rows to another number of ranks."""

import json
import shutil
import sys

import pytest

from conftest import Job, kill_all, kill_each_after, resumed_step, run
from fabric_utils.checkpoint import write_manifest

# 256 rows, 16 per optimizer step: 16 steps per epoch, 32 in all, a checkpoint every 4
FLAGS = ["--demo", "--accelerator", "cpu", "--precision", "32-true", "--num-workers", "0", "--max-length", "32",
         "--train-size", "256", "--val-size", "40", "--test-size", "40", "--batch-size", "8", "--epochs", "2",
         "--lr", "4e-3", "--hidden-dropout", "0", "--save-every", "4", "--log-every", "4", "--quiet"]
COMPARED = ("val_loss", "val_acc", "test_loss", "test_acc")


def devices(n: int, strategy: str = "ddp") -> list[str]:
    """16 rows per optimizer step on ``n`` processes; a resume on the other number keeps these flags, as a requeued
    job's command line does, and the loop changes the accumulation."""
    return ["--devices", str(n), "--strategy", strategy, "--grad-accum", str(2 // n)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run on 2 processes; runs killed after step 8 (mid-epoch) and resumed on the other number."""
    root = tmp_path_factory.mktemp("devices")
    started = {"full": ("full", 2, "ddp"), "2to1": ("2to1", 2, "ddp"), "1to2": ("1to2", 1, "ddp"),
               "fsdp2_2to1": ("fsdp2_2to1", 2, "fsdp2")}
    jobs = {name: Job(root / folder, *FLAGS, *devices(n, strategy)) for name, (folder, n, strategy) in started.items()}
    try:
        kill_each_after([jobs[name] for name in started if name != "full"], "step-000008")
        for name, (folder, n, strategy) in started.items():
            if name != "full":
                jobs[name + "_resumed"] = Job(root / folder, *FLAGS, *devices(3 - n, strategy), "--resume", "auto")
        yield {name: (job.results() if name == "full" or name.endswith("_resumed") else None, job)
               for name, job in jobs.items()}
    finally:
        kill_all(jobs)


@pytest.mark.parametrize("name", ["2to1", "1to2", "fsdp2_2to1"])
def test_a_run_resumed_on_another_number_of_devices_ends_where_the_uninterrupted_run_ends(runs, name):
    full, _ = runs["full"]
    resumed, job = runs[name + "_resumed"]
    before, after = (2, 1) if name.endswith("2to1") else (1, 2)
    assert resumed_step(job.output()) == 8  # mid-epoch: the epoch goes on at row 128 of 256
    accumulation = 2 // after
    assert (f"resuming with world size {after} instead of {before}: --grad-accum {accumulation} keeps 16 rows per "
            f"optimizer step") in job.output()
    assert resumed["world_size"] == after and resumed["steps"] == full["steps"] == 32
    assert resumed["config"]["grad_accum"] == accumulation
    assert {key: resumed[key] for key in COMPARED} == pytest.approx({key: full[key] for key in COMPARED}, abs=1e-4)
    # the same rows seen: every training row once an epoch, counted by the throughput monitor of each segment
    assert resumed["train_examples"] == 256


def test_a_checkpoint_that_cannot_be_resharded_is_refused_with_one_line(tmp_path):
    """A folder of DeepSpeed shards written by 2 processes, resumed by 1: refused before anything loads."""
    from fabric_utils.resume import load_checkpoint
    from fabric_utils.errors import UserError
    from fabric_utils.launcher import build_fabric

    checkpoint = tmp_path / "step-000004"
    (checkpoint / "state").mkdir(parents=True)  # a sharded checkpoint is a folder of shards
    (checkpoint / "record.json").write_text(json.dumps({"world_size": 2, "fingerprint": {"seed": 1}}))
    fabric = build_fabric(accelerator="cpu", devices=1, strategy="auto", precision="32-true")
    with pytest.raises(UserError, match=r"holds the shards of 2 processes, which SingleDeviceStrategy cannot reshard "
                                        r"for 1: resume on 2 \(ddp and fsdp2 checkpoints"):
        load_checkpoint(fabric, checkpoint, {"step": 0, "fingerprint": {"seed": 1}},
                        expected_fingerprint={"seed": 1})


def test_an_error_on_one_rank_is_one_line_naming_it_and_no_rank_prints_a_traceback(runs, tmp_path):
    """Rank 1's own RNG file is damaged: rank 1 says so, naming itself; rank 0, whose next collective fails, stops with
    one line and no traceback."""
    _, full = runs["full"]
    checkpoint = shutil.copytree(sorted((full.out_dir / "checkpoints").glob("step-*"))[-1], tmp_path / "step")
    rng = checkpoint / "rng-rank1.pt"
    rng.write_bytes(b"\0" * rng.stat().st_size)
    write_manifest(checkpoint)  # as a hand can: only loading it can tell
    done = run([sys.executable, "train.py", *FLAGS, *devices(2), "--out-dir", str(tmp_path / "run"), "--resume",
                str(checkpoint)], timeout=300, check=False)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error (rank 1): cannot restore checkpoint {checkpoint}: its rng-rank1.pt is damaged or was not written by "
        f"train.py ("), done.stderr[-3000:]
