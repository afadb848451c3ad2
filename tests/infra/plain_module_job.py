"""A job with no Hugging Face in it: a plain ``torch.nn.Module`` with its own loss and a torch schedule, trained through
fabric_utils alone (launcher, optimizer, checkpoints and resume, throughput, progress, loggers) on any number of
processes.

    python tests/plain_module_job.py OUT_DIR --devices 2 --steps 8 [--stop-after 4] [--resume]

Writes OUT_DIR/result.json with the final weights' checksum and loss, so a test can compare an uninterrupted run
with one stopped and resumed."""

import argparse
import json
import sys
from pathlib import Path

import torch
from torchmetrics import MetricCollection
from torchmetrics.regression import MeanSquaredError

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fabric_utils.checkpoint import save_checkpoint  # noqa: E402
from fabric_utils.launcher import build_fabric, end_job, launch  # noqa: E402
from fabric_utils.loggers import make_loggers  # noqa: E402
from fabric_utils.optim import build_optimizer  # noqa: E402
from fabric_utils.progress import Progress, Throughput  # noqa: E402
from fabric_utils.resume import agreed_resume_checkpoint, load_checkpoint  # noqa: E402
from fabric_utils.flops import training_flops_fn  # noqa: E402


class Regressor(torch.nn.Module):
    _no_split_modules = ["Linear"]  # the units fsdp2 shards one by one (Hugging Face models list their layers here)

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


def huber(prediction, target):  # the job's own loss
    return torch.nn.functional.smooth_l1_loss(prediction, target)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out_dir", type=Path)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--stop-after", type=int)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()

    fabric = build_fabric(accelerator="cpu", devices=args.devices, strategy=args.strategy, precision="32-true",
                          grad_clip=1.0, loggers=make_loggers("csv", args.out_dir, project="plain"))
    launch(fabric)
    fabric.seed_everything(7)
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    y = x.sum(dim=1) + 0.1 * torch.randn(256, generator=torch.Generator().manual_seed(1))

    model = Regressor()
    flops_of = training_flops_fn(model, lambda m, batch: huber(m(batch[0]), batch[1]),
                                 lambda size: (torch.zeros(1, 8), torch.zeros(1)), max_size=None)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(build_optimizer(model, name="adamw", lr=3e-2, weight_decay=0.01,
                                                        device=fabric.device))
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=args.steps)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0,
             "fingerprint": {"job": "plain"}}
    ckpt_dir = args.out_dir / "checkpoints"
    if args.resume:
        load_checkpoint(fabric, agreed_resume_checkpoint(fabric, "auto", ckpt_dir), state,
                        expected_fingerprint={"job": "plain"})
    progress = Progress(fabric, args.steps, quiet=True, metrics=MetricCollection({"mse": MeanSquaredError()}),
                        steps_per_epoch=args.steps, rows_per_step=16 * fabric.world_size)
    monitor = Throughput(fabric, peak_tflops=1.0, flops_of=flops_of, sized=False)
    monitor.start(state["step"])
    while state["step"] < args.steps:
        # each step's rows follow from the step alone (a fresh shuffle, this rank's share), so a resume needs no
        # sampler state
        rows = torch.randperm(256, generator=torch.Generator().manual_seed(state["step"]))
        rows = rows[fabric.global_rank * 16:(fabric.global_rank + 1) * 16]
        inputs, targets = fabric.to_device((x[rows], y[rows]))
        prediction = model(inputs)
        loss = huber(prediction, targets)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        progress.update(loss, prediction, targets)
        monitor.count(len(targets), None, computed=(len(targets), None))
        state["step"] += 1
        logged = progress.log(state["step"], scheduler.get_last_lr()[0])
        monitor.log(state["step"])
        if state["step"] == args.stop_after:
            save_checkpoint(fabric, ckpt_dir, f"step-{state['step']:06d}", state)
            break
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    result = {"checksum": checksum, "loss": logged["train/loss"], "lr": scheduler.get_last_lr()[0],
              "world_size": fabric.world_size, **monitor.stop()}
    if fabric.is_global_zero:
        (args.out_dir / "result.json").write_text(json.dumps(result))
    end_job(fabric)  # no rank leaves while another still has a collective in flight, nor with its process group up


if __name__ == "__main__":
    main()
