"""Precision: fp16 with loss scaling (run on CPU through the test-only shim), how --precision auto reads the
hardware, and bf16-true's lost updates."""

import math
import os
import sys
import warnings

import pytest
import torch

from conftest import REPO, SHIMS, SMALL_DEMO, build_fabric_from_flags, logged, run, train
from fabric_utils.launcher import warn_if_updates_vanish

FP16_CPU = ["--accelerator", "cpu", "--precision", "16-mixed", *SMALL_DEMO, "--log-every", "1"]


@pytest.fixture
def fp16_cpu(monkeypatch):
    """Child processes get real fp16 autocast and a GradScaler on CPU (tests/shims/sitecustomize.py)."""
    monkeypatch.setenv("FABRIC_TEMPLATE_FP16_CPU", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SHIMS), str(REPO)]))
    return monkeypatch


def test_fp16_overflow_steps_are_skipped_and_training_goes_on(fp16_cpu, tmp_path):
    # a first scale far above what fp16 gradients hold: the first steps overflow until the scaler has halved it
    # enough, as on a GPU (where it starts at 2**16 and overflows again each time it doubles)
    fp16_cpu.setenv("FABRIC_TEMPLATE_FP16_CPU_INIT_SCALE", str(2.0**24))
    steps = 12
    results = train([*FP16_CPU, "--max-steps", steps, "--save-every", steps], tmp_path)
    assert results["precision"] == "16-mixed" and results["steps"] == steps
    # AdamW counts only the steps it took: the scaler skipped the overflow steps, and took the others
    state = torch.load(tmp_path / "checkpoints" / f"step-{steps:06d}" / "state", weights_only=False)
    adam_steps = {int(s["step"]) for s in state["optimizer"]["state"].values()}
    assert len(adam_steps) == 1 and 0 < adam_steps.pop() < steps
    # the scaler only touches gradients: the loss of an overflow step is finite, so the finite-loss check stays on
    losses = list(logged(tmp_path, "train/loss").values())
    assert len(losses) == steps and all(math.isfinite(loss) for loss in losses)


def test_fp16_run_that_diverges_still_stops_with_one_line(fp16_cpu, tmp_path):
    # the scaler skips steps whose gradients overflow, but weights that grew too large overflow fp16 in the
    # forward pass: the loss goes non-finite, every later step is skipped, and only the loss check can tell
    result = run([sys.executable, "train.py", *FP16_CPU, "--lr", "1e6", "--grad-clip", "0", "--max-steps", "10",
                  "--out-dir", str(tmp_path)], check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "error: the training loss became" in result.stderr
    assert not (tmp_path / "results.json").exists()


def test_bf16_true_precision_warns_that_small_updates_vanish():
    with pytest.warns(UserWarning, match=r"bf16-true .* at --lr 5e-05, .* use bf16-mixed"):
        warn_if_updates_vanish(build_fabric_from_flags("--accelerator", "cpu", "--precision", "bf16-true").strategy
                               .precision, lr=5e-5)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*rounds away updates")
        warn_if_updates_vanish(build_fabric_from_flags("--accelerator", "cpu", "--precision", "bf16-mixed").strategy
                               .precision, lr=5e-5)
