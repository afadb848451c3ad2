"""Precision: fp16 with loss scaling (run on CPU through the test-only shim, tests/shims/sitecustomize.py): overflow
steps are skipped, a resume continues exactly as the loss scaler's state travels with the checkpoint, and a batch
whose forward pass overflows fp16 does not stop the run; how --precision auto reads the hardware, and bf16-true's
lost updates."""

import math
import shutil
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from torchmetrics import MetricCollection
from torchmetrics.regression import MeanSquaredError

from conftest import SMALL_DEMO, build_fabric_from_flags, logged, run, shimmed, train
from fabric_utils.args import RUN_MARKER
from fabric_utils.launcher import warn_if_updates_vanish
from fabric_utils.progress import Progress

FP16_CPU = ["--accelerator", "cpu", "--precision", "16-mixed", *SMALL_DEMO, "--log-every", "1"]
STEPS, RESUME_AT = 12, 6
OVERFLOWING = [*FP16_CPU, "--max-steps", STEPS, "--save-every", RESUME_AT, "--keep-last", "2"]


def use_fp16_cpu(monkeypatch) -> None:
    """Child processes get real fp16 autocast and a GradScaler on CPU (tests/shims/sitecustomize.py)."""
    for name, value in shimmed(FABRIC_TEMPLATE_FP16_CPU="1").items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def fp16_cpu(monkeypatch):
    use_fp16_cpu(monkeypatch)
    return monkeypatch


def use_overflowing_scale(monkeypatch) -> None:
    """A first scale far above what fp16 gradients hold: the first steps overflow until the scaler has halved it
    enough, as on a GPU (where it starts at 2**16 and overflows again each time it doubles)."""
    monkeypatch.setenv("FABRIC_TEMPLATE_FP16_CPU_INIT_SCALE", str(2.0**24))


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory):
    """One 16-mixed run of STEPS steps from the overflowing scale, checkpoints at RESUME_AT and at the end: the
    overflow test reads it, the resume test continues it. Its folder and results."""
    out = tmp_path_factory.mktemp("fp16") / "full"
    with pytest.MonkeyPatch.context() as env:
        use_fp16_cpu(env)
        use_overflowing_scale(env)
        return out, train(OVERFLOWING, out)


def adam_steps(checkpoint) -> set[int]:
    return {int(s["step"]) for s in checkpoint["optimizer"]["state"].values()}


def test_fp16_overflow_steps_are_skipped_and_training_goes_on(overflowing):
    out, results = overflowing
    assert results["precision"] == "16-mixed" and results["steps"] == STEPS
    # AdamW counts only the steps it took: the scaler skipped the overflow steps, and took the others
    steps = adam_steps(torch.load(out / "checkpoints" / f"step-{STEPS:06d}" / "state", weights_only=False))
    assert len(steps) == 1 and 0 < steps.pop() < STEPS
    # the scaler only touches gradients: the loss of an overflow step is finite, so the finite-loss check stays on
    losses = list(logged(out, "train/loss").values())
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses)


def test_fp16_resume_continues_with_the_scale_the_run_had(overflowing, fp16_cpu, tmp_path):
    """A first scale far above what fp16 holds: the first steps overflow while the scaler halves it. A resume used to
    start at the first scale again and skip steps the uninterrupted run took."""
    full_dir, full = overflowing
    use_overflowing_scale(fp16_cpu)
    # the resumed run starts from a copy of the uninterrupted run's checkpoint at RESUME_AT
    resumed_dir = tmp_path / "resumed" / "checkpoints" / f"step-{RESUME_AT:06d}"
    shutil.copytree(full_dir / "checkpoints" / f"step-{RESUME_AT:06d}", resumed_dir)
    shutil.copy(full_dir / RUN_MARKER, tmp_path / "resumed")  # a run's folder, as a copy of the run would be
    resumed = train([*OVERFLOWING, "--resume", resumed_dir], tmp_path / "resumed")

    ends = [torch.load(run / "checkpoints" / f"step-{STEPS:06d}" / "state", weights_only=True)
            for run in (full_dir, tmp_path / "resumed")]
    start = torch.load(resumed_dir / "state", weights_only=True)
    assert 0 < min(adam_steps(start)) < RESUME_AT  # overflow steps were skipped before the checkpoint
    assert adam_steps(ends[1]) == adam_steps(ends[0])
    assert ends[1]["loss_scaler"] == ends[0]["loss_scaler"] and ends[0]["loss_scaler"]["scale"] < 2.0**24
    assert resumed["test_loss"] == full["test_loss"]


def test_a_batch_whose_loss_overflowed_is_left_out_of_the_logged_loss():
    """The scaler skips the step of a batch whose fp16 forward overflowed (its gradients are not finite either);
    the logged loss used to become inf, which stops the run. Only a window with no finite loss stops it."""
    fabric = SimpleNamespace(device=torch.device("cpu"), is_global_zero=True, log_dict=lambda logged, step: None,
                             all_reduce=lambda tensor, reduce_op: tensor,
                             strategy=SimpleNamespace(precision=SimpleNamespace(precision="16-mixed")))
    progress = Progress(fabric, total_steps=4, quiet=True, metrics=MetricCollection({"mse": MeanSquaredError()}),
                        steps_per_epoch=4, rows_per_step=6)
    for loss in (1.0, float("inf"), 3.0):
        progress.update(torch.tensor(loss), torch.zeros(2), torch.zeros(2))
    assert progress.log(step=3, lr=0.1)["train/loss"] == 2.0
    progress.update(torch.tensor(float("nan")), torch.zeros(2), torch.zeros(2))
    assert math.isnan(progress.log(step=4, lr=0.1)["train/loss"])


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
