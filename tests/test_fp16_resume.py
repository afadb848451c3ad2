"""16-mixed: a resume continues exactly, as the loss scaler's state travels with the checkpoint (real fp16 on CPU
through the test-only shim, tests/shims/sitecustomize.py), and a batch whose forward pass overflows fp16 does not
stop the run."""

import math
import shutil
from types import SimpleNamespace

import torch
from torchmetrics import MetricCollection
from torchmetrics.regression import MeanSquaredError

from conftest import train
from fabric_utils.progress import Progress
from test_precision import FP16_CPU, fp16_cpu  # noqa: F401 (a fixture)

STEPS, RESUME_AT = 12, 6


def adam_steps(checkpoint) -> set[int]:
    return {int(s["step"]) for s in checkpoint["optimizer"]["state"].values()}


def test_fp16_resume_continues_with_the_scale_the_run_had(fp16_cpu, tmp_path):  # noqa: F811
    """A first scale far above what fp16 holds: the first steps overflow while the scaler halves it. A resume used to
    start at the first scale again and skip steps the uninterrupted run took."""
    fp16_cpu.setenv("FABRIC_TEMPLATE_FP16_CPU_INIT_SCALE", str(2.0**24))
    flags = [*FP16_CPU, "--max-steps", STEPS, "--save-every", RESUME_AT, "--keep-last", "2"]
    full = train(flags, tmp_path / "full")
    # the resumed run starts from a copy of the uninterrupted run's checkpoint at RESUME_AT
    resumed_dir = tmp_path / "resumed" / "checkpoints" / f"step-{RESUME_AT:06d}"
    shutil.copytree(tmp_path / "full" / "checkpoints" / f"step-{RESUME_AT:06d}", resumed_dir)
    resumed = train([*flags, "--resume", resumed_dir], tmp_path / "resumed")

    ends = [torch.load(run / "checkpoints" / f"step-{STEPS:06d}" / "state", weights_only=True)
            for run in (tmp_path / "full", tmp_path / "resumed")]
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
    progress = Progress(fabric, total_steps=4, quiet=True, metrics=MetricCollection({"mse": MeanSquaredError()}))
    for loss in (1.0, float("inf"), 3.0):
        progress.update(torch.tensor(loss), torch.zeros(2), torch.zeros(2))
    assert progress.log(step=3, lr=0.1)["train/loss"] == 2.0
    progress.update(torch.tensor(float("nan")), torch.zeros(2), torch.zeros(2))
    assert math.isnan(progress.log(step=4, lr=0.1)["train/loss"])
