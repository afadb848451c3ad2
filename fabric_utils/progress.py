"""Rank 0's view of training: a tqdm bar on a terminal, plain log lines otherwise (CI, cluster logs)."""

import sys

import torch


class Progress:
    """Training loss and the task's metrics since the last log step, logged and shown on rank 0.

    Everything is summed on the device and read back only at log steps, so the hot loop never waits. Under 16-mixed
    the logged loss is the mean over the micro-batches whose loss was finite, and not a number only when none was:
    a forward pass can overflow fp16 now and then, and the loss scaler (Fabric's or DeepSpeed's) skips that step, so
    one such batch must not make the loss inf and stop the run; a run that diverged has no finite loss left. In
    other precisions nothing skips a step, so one non-finite loss already means diverged weights."""

    def __init__(self, fabric, total_steps: int, quiet: bool, metrics):
        self.fabric = fabric
        self.metrics = metrics.to(fabric.device)  # a torchmetrics collection; compute() sums over ranks
        self.loss_sum, self.rows = torch.zeros((), device=fabric.device), torch.zeros((), device=fabric.device)
        self.skips_overflow = fabric.strategy.precision.precision == "16-mixed"
        self.enabled = fabric.is_global_zero and not quiet
        self.bar = None
        if self.enabled and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, desc="train", dynamic_ncols=True)

    def update(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        loss = loss.detach().float()
        if self.skips_overflow:  # the scaler skips the step of a loss that overflowed: leave that loss out too
            finite = torch.isfinite(loss)
            self.loss_sum += torch.where(finite, loss, 0.0) * len(labels)
            self.rows += finite * len(labels)
        else:
            self.loss_sum += loss * len(labels)
            self.rows += len(labels)
        self.metrics.update(logits.detach(), labels)

    def log(self, step: int, lr: float) -> dict:
        """Loss and metrics since the last log over all ranks: every rank gets the same numbers, so a check on
        them (a non-finite loss) stops all ranks together instead of leaving the others waiting in a collective."""
        sums = torch.stack([self.loss_sum, self.rows])
        loss_sum, rows = self.fabric.all_reduce(sums, reduce_op="sum").tolist()  # sync: log steps only
        computed = {f"train/{k}": v.item() for k, v in self.metrics.compute().items()}  # sync: log steps only
        logged = {"train/loss": loss_sum / rows if rows else float("nan"), **computed, "lr": lr}
        self.fabric.log_dict(logged, step=step)
        self.loss_sum.zero_()
        self.rows.zero_()
        self.metrics.reset()
        self.step, self.logged = step, logged
        return logged

    def show(self, throughput: dict) -> None:
        if not self.enabled:
            return
        shown = {name.removeprefix("train/"): f"{value:.4g}" for name, value in self.logged.items()}
        # the monitor reports rates once its window is full; "samples_per_sec" (all ranks) only with several
        samples_per_sec = throughput.get("samples_per_sec", throughput.get("device/samples_per_sec"))
        if samples_per_sec is not None:
            shown["samples/s"] = f"{samples_per_sec:.1f}"
        if self.bar is not None:
            self.bar.n = self.step
            self.bar.set_postfix(shown, refresh=True)
        else:
            print(f"step {self.step}: " + ", ".join(f"{k} {v}" for k, v in shown.items()), flush=True)
