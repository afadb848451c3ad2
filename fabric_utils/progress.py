"""What a run prints: lines from the job's first process only, a progress bar on a terminal and plain log lines
otherwise (CI, cluster logs), and no noise from the libraries underneath."""

import datetime
import logging
import sys
import time
import warnings

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only


@rank_zero_only
def say(*lines: str) -> None:
    """Prints on the job's global rank 0 only: ``fabric.print`` prints on every node's first process, so a 2-node
    log would show each line twice."""
    print(*lines, flush=True)


def silence_libraries() -> None:
    """What the libraries under the loop print on every process and a run does not need (``--verbose`` keeps it):
    Lightning's start-up notes (the header says the same once), hints and deprecations aimed at Lightning's own code,
    and DeepSpeed's guess of the accelerator (transformers' save_pretrained imports DeepSpeed through accelerate)."""
    for name in ("lightning.fabric", "lightning.pytorch"):  # the latter's logger takes Fabric's notes once imported
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message="The `srun` command is available",
                            module="lightning.fabric.plugins.environments.slurm")
    warnings.filterwarnings("ignore", message="torch.distributed.nn.functional.all_gather is deprecated",
                            module="lightning.fabric.utilities.distributed")
    logging.getLogger("DeepSpeed").addFilter(lambda record: "Setting accelerator to" not in record.getMessage())


def shows_bars(fabric, quiet: bool, verbose: bool) -> bool:
    """Whether this process draws progress bars (training's, and the libraries' own): the first, on a terminal."""
    return fabric.is_global_zero and not quiet and (verbose or sys.stderr.isatty())


STUCK_WITHIN = 0.99  # a loss above 99% of chance level has not left it


class Progress:
    """Training loss and the task's metrics since the last log step, logged and shown on rank 0 with the step, the
    epoch, the rate and the time left.

    Everything is summed on the device and read back only at log steps, so the hot loop never waits. Under 16-mixed
    the logged loss is the mean over the micro-batches whose loss was finite, and not a number only when none was:
    a forward pass can overflow fp16 now and then, and the loss scaler (Fabric's or DeepSpeed's) skips that step, so
    one such batch must not make the loss inf and stop the run; a run that diverged has no finite loss left. In
    other precisions nothing skips a step, so one non-finite loss already means diverged weights."""

    def __init__(self, fabric, total_steps: int, quiet: bool, metrics, steps_per_epoch: int | None = None,
                 rows_per_step: int | None = None, start_step: int = 0, chance_loss: float | None = None):
        self.fabric = fabric
        self.chance_loss, self.left_chance = chance_loss, False
        self.metrics = metrics.to(fabric.device)  # a torchmetrics collection; compute() sums over ranks
        self.loss_sum, self.rows = torch.zeros((), device=fabric.device), torch.zeros((), device=fabric.device)
        self.skips_overflow = fabric.strategy.precision.precision == "16-mixed"
        self.enabled = fabric.is_global_zero and not quiet
        self.total, self.rows_per_step = total_steps, rows_per_step
        self.steps_per_epoch = steps_per_epoch or total_steps
        self.start_step, self.start_time = start_step, time.monotonic()
        self.bar = None
        if self.enabled and sys.stdout.isatty():  # where the log lines would go: a log file gets lines
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stdout)

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
        if self.chance_loss is not None and logged["train/loss"] < STUCK_WITHIN * self.chance_loss:
            self.left_chance = True
        return logged

    def stuck_at_chance(self) -> bool:
        """True at the run's last log step if the training loss has not left chance level (what a model that ignores
        its inputs scores) at any log step: a run that did not learn. Judged at the end, as a run may leave chance
        level late (a model trained from random weights, adapters at a low rate) and then learn."""
        return self.chance_loss is not None and not self.left_chance and self.step >= self.total

    def show(self) -> None:
        """The last logged step: the bar's numbers, or one line such as ``step 40/120 (epoch 1/3): loss 0.41,
        acc 0.83, lr 0.0019, 52.1 rows/s, 0:00:12 left``."""
        if not self.enabled:
            return
        shown = {name.removeprefix("train/"): f"{value:.4g}" for name, value in self.logged.items()}
        epochs = -(-self.total // self.steps_per_epoch)
        epoch = f"epoch {min((self.step - 1) // self.steps_per_epoch + 1, epochs)}/{epochs}"
        if self.bar is not None:  # tqdm shows the rate and the time left itself
            self.bar.set_description(epoch, refresh=False)
            self.bar.update(self.step - self.bar.n)
            self.bar.set_postfix(shown, refresh=True)
            return
        seconds = time.monotonic() - self.start_time
        done = self.step - self.start_step
        parts = [f"{name} {value}" for name, value in shown.items()]
        if self.rows_per_step:
            parts.append(f"{done * self.rows_per_step / seconds:.1f} rows/s")
        parts.append(f"{datetime.timedelta(seconds=round(seconds / done * (self.total - self.step)))} left")
        print(f"step {self.step}/{self.total} ({epoch}): " + ", ".join(parts), flush=True)

    def note(self, line: str) -> None:
        """A line between log steps (a validation result), printed above the bar where there is one."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
