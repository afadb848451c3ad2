"""What a run prints and measures as it trains: rank 0 prints, a bar on a terminal or lines in a log."""

import contextlib
import datetime
import logging
import math
import sys
import time
import warnings
from collections.abc import Callable

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.throughput import ThroughputMonitor
from tqdm import tqdm

from fabric_utils.errors import UserError
from fabric_utils.private import dynamo_counters
from fabric_utils.strategy import precision_name, silence_engines


@rank_zero_only
def say(*lines: str) -> None:
    """Prints on global rank 0 only (``fabric.print`` prints once per node)."""
    print(*lines, flush=True)


def silence_libraries() -> None:
    """Drops what the libraries print on every process and a run does not need (``--verbose`` keeps it)."""
    for name in ("lightning.fabric", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message="The `srun` command is available",
                            module="lightning.fabric.plugins.environments.slurm")
    warnings.filterwarnings("ignore", message="torch.distributed.nn.functional.all_gather is deprecated",
                            module="lightning.fabric.utilities.distributed")
    # torchao, which transformers imports where installed, lists kernels it cannot load; _pytree, its deprecations
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    silence_engines()


def header(fabric, config, spec, max_steps: int, steps_per_epoch: int, out_dir, threads: str, rule) -> str:
    splits = ", ".join(f"{len(rows):,} {name}" for name, rows in spec.datasets.items())
    devices, nodes = fabric.world_size, getattr(fabric.strategy, "num_nodes", 1)
    return "\n".join([
        f"data      {splits} rows",
        f"training  {max_steps:,} optimizer steps ({max_steps / steps_per_epoch:.3g} "
        f"epoch{'s' * (max_steps != steps_per_epoch)} of {steps_per_epoch:,}), "
        f"{config.batch_size * devices * config.grad_accum:,} rows each ({config.batch_size} per device x "
        f"{devices} device{'s' * (devices > 1)} x --grad-accum {config.grad_accum}), peak --lr {config.lr:.3g}",
        f"launch    {devices} {fabric.device.type} process{'es' * (devices > 1)}"
        + (f" on {nodes} nodes" if nodes > 1 else "")
        + f", {type(fabric.strategy).__name__}, precision {precision_name(fabric, config.precision)}, "
          f"{threads} per process",
        f"run       {out_dir} (environment.json there: versions and hardware), checkpoints/best by validation "
        f"{rule.metric} ({rule.direction})"])


def shows_bars(fabric, quiet: bool, verbose: bool) -> bool:
    """Whether this process draws progress bars, training's and the libraries': rank 0, on a terminal."""
    return fabric.is_global_zero and not quiet and (verbose or sys.stderr.isatty())


def counted(fabric, batches, name: str, every_s: float = 30.0):
    """Yields ``batches``, shown on rank 0: a bar on a terminal, else a line every ``every_s`` seconds."""
    if not fabric.is_global_zero:
        yield from batches
        return
    if sys.stdout.isatty():
        yield from tqdm(batches, desc=name, unit="batch", leave=False, dynamic_ncols=True, file=sys.stdout)
        return
    total, start = len(batches), time.monotonic()
    last = start
    for done, batch in enumerate(batches, start=1):
        yield batch
        now = time.monotonic()
        if now - last >= every_s and done < total:
            left = datetime.timedelta(seconds=round((now - start) / done * (total - done)))
            print(f"{name}: {done}/{total} batches, {left} left", flush=True)
            last = now


# fractions of chance level a run stays above if it has not learned (a stalled run still fits its own rows a little)
STUCK_WITHIN = {"validation": 0.99, "train": 0.95}


def last_quarter_mean(losses: list[float]) -> float:
    last_quarter = losses[-max(1, len(losses) // 4):]
    return sum(last_quarter) / len(last_quarter)


def at_chance(train_losses: list[float], val_loss: float, chance_loss: dict[str, float]) -> bool:
    """Whether a finished run has not learned: its last quarter's mean training loss and its validation loss are both
    at chance (one log step's loss can dip by chance; a run that learned a little can keep its training loss there)."""
    return (last_quarter_mean(train_losses) >= STUCK_WITHIN["train"] * chance_loss["train"]
            and val_loss >= STUCK_WITHIN["validation"] * chance_loss["validation"])


class Progress:
    """Training loss and metrics since the last log step, summed on the device so that only log steps sync."""

    def __init__(self, fabric, total_steps: int, quiet: bool, metrics, steps_per_epoch: int, rows_per_step: int,
                 start_step: int = 0, chance_loss: dict[str, float] | None = None, losses: list[float] | None = None):
        self.fabric = fabric
        # the logged losses for the stuck-at-chance check: a checkpoint's, appended to in place, or new
        self.chance_loss, self.losses = chance_loss, [] if losses is None else losses
        self.metrics = metrics.to(fabric.device)
        self.sums = torch.zeros(2, device=fabric.device)  # the loss times its rows, and the rows
        self.skips_overflow = fabric.strategy.precision.precision == "16-mixed"
        self.enabled = fabric.is_global_zero and not quiet
        self.total, self.steps_per_epoch, self.rows_per_step = total_steps, steps_per_epoch, rows_per_step
        self.start_step, self.step, self.start_time = start_step, start_step, time.monotonic()
        # a bar on a terminal; elsewhere show() prints a line
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                        file=sys.stdout) if self.enabled and sys.stdout.isatty() else None

    def update(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        loss, rows = loss.detach().float(), len(labels)
        if self.skips_overflow:  # the scaler skips an overflowed loss's step: leave the loss out too
            finite = torch.isfinite(loss)
            loss, rows = torch.where(finite, loss, 0.0), finite * rows
        self.sums[0] += loss * rows
        self.sums[1] += rows
        self.metrics.update(logits.detach(), labels)

    def log(self, step: int, lr: float) -> dict:
        """Loss and metrics since the last log, the same on every rank so that a check on them stops all together."""
        loss_sum, rows = self.fabric.all_reduce(self.sums, reduce_op="sum").tolist()
        computed = {f"train/{k}": v.item() for k, v in self.metrics.compute().items()}
        logged = {"train/loss": loss_sum / rows if rows else float("nan"), **computed, "lr": lr}
        self.fabric.log_dict(logged, step=step)
        self.sums.zero_()
        self.metrics.reset()
        self.step, self.logged = step, logged
        self.losses.append(logged["train/loss"])
        return logged

    def log_step(self, step: int, lr: float, max_lr: float, throughput: "Throughput") -> None:
        """``log``, ``throughput``'s rates and ``show``: a log step's syncs, all here."""
        logged = self.log(step, lr)
        if not math.isfinite(logged["train/loss"]):
            raise UserError(f"the training loss became {logged['train/loss']} by step {step}: lower --lr (now "
                            f"{max_lr}), keep --grad-clip on, or use --precision bf16-mixed/32-true")
        throughput.log(step)
        self.show()

    def warn_if_stuck(self, val_loss: float, max_lr: float) -> bool:
        """At the last step (some runs leave chance late), says so if the run has not learned; returns whether."""
        chance = self.chance_loss
        if chance is None or self.step < self.total or not at_chance(self.losses, val_loss, chance):
            return False
        say(f"the training loss stayed at chance level ({chance['train']:.3g}, or just under: what a model that "
            f"ignores its inputs scores) over the last quarter of the run, and the validation loss ended there too "
            f"({val_loss:.3g} against {chance['validation']:.3g}), up to step {self.step}: it has not learned; try "
            f"a lower --lr (now {max_lr:g}) if the loss jumped there at once, else a higher one or more --epochs")
        return True

    def show(self) -> None:
        """The last logged step: the bar's numbers, or a line ``step 40/120 (epoch 1/3): loss 0.41, ... left``."""
        if not self.enabled:
            return
        shown = {name.removeprefix("train/"): f"{value:.4g}" for name, value in self.logged.items()}
        epochs = -(-self.total // self.steps_per_epoch)
        epoch = f"epoch {min((self.step - 1) // self.steps_per_epoch + 1, epochs)}/{epochs}"
        if self.bar is not None:
            self.bar.set_description(epoch, refresh=False)
            self.bar.update(self.step - self.bar.n)
            self.bar.set_postfix(shown, refresh=True)
            return
        seconds, done = time.monotonic() - self.start_time, self.step - self.start_step
        left = datetime.timedelta(seconds=round(seconds / done * (self.total - self.step)))
        parts = [f"{name} {value}" for name, value in shown.items()]
        print(f"step {self.step}/{self.total} ({epoch}): {', '.join(parts)}, "
              f"{done * self.rows_per_step / seconds:.1f} rows/s, {left} left", flush=True)

    def note(self, line: str) -> None:
        """A line between log steps, above the bar where there is one."""
        if self.bar is not None:
            self.bar.write(line)
        elif self.enabled:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Throughput:
    """Rows, sizes and FLOPs counted on the host (no device read) for Fabric's ``ThroughputMonitor``, over training
    time alone (``paused()`` leaves validation and checkpoints out)."""

    def __init__(self, fabric, peak_tflops: float | None, flops_of: Callable[[int, int, int], float] | None,
                 sized: bool):
        self.fabric, self.flops_of, self.sized = fabric, flops_of, sized
        self.monitor = ThroughputMonitor(fabric, window_size=5)
        if peak_tflops:  # Fabric knows common GPUs' only
            self.monitor.available_flops = peak_tflops * 1e12
        # rows, sizes, sum of sizes², real then as computed (filling rows, padding), on the host
        self.counts = torch.zeros(2, 3, dtype=torch.int64)
        self.flops_logged = 0.0

    def start(self, step: int) -> None:
        if self.fabric.device.type == "cuda":  # not the batch-size finder's or warm-up's peak
            torch.cuda.reset_peak_memory_stats(self.fabric.device)
        self.start_time, self.start_step, self.paused_s = time.perf_counter(), step, 0.0
        self.graphs_at_start = dynamo_counters["stats"]["unique_graphs"]

    def recompiles(self) -> int:
        """Graphs torch.compile built since ``start()``, after warm-up: each a stall."""
        return dynamo_counters["stats"]["unique_graphs"] - self.graphs_at_start

    @contextlib.contextmanager
    def paused(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - start

    def seconds(self) -> float:
        return time.perf_counter() - self.start_time - self.paused_s

    def count(self, rows: int, sizes: torch.Tensor | None, computed: tuple[int, int | None]) -> None:
        """``sizes``: each row's, on the host, where the task gives them; ``computed``: the (rows, row size) the
        device computes, filling rows and padding included (MFU over padded tokens; size None without sizes)."""
        real = torch.tensor([rows, 0, 0]) if sizes is None else torch.stack(  # no value read: a tensor op
            (torch.ones_like(sizes).sum(), sizes.sum(), (sizes * sizes).sum()))
        filled, size = computed[0], computed[1] or 0  # no sizes: no tokens
        self.counts += torch.stack((real, torch.tensor([filled, filled * size, filled * size * size])))

    def log(self, step: int) -> dict:
        rows, tokens, tokens_sq = self.counts[0].tolist()
        flops = self.flops_of(rows, tokens, tokens_sq) if self.flops_of else None
        self.monitor.update(time=self.seconds(), batches=step - self.start_step, samples=rows,
                            lengths=tokens if self.sized else None,  # it takes FLOPs since its last update
                            flops=None if flops is None else flops - self.flops_logged)
        self.flops_logged = flops
        if dynamo_counters["stats"]["unique_graphs"]:
            self.fabric.log("compile/recompiles", self.recompiles(), step=step)
        return self.monitor.compute_and_log(step=step)

    def stop(self) -> dict:
        """Over all ranks: seconds, rows/s, tokens/s (with sizes), MFU over real tokens and over the tokens computed
        (padded; None: peak unknown)."""
        seconds, peak = self.seconds(), self.monitor.available_flops
        counts = self.counts.double().to(self.fabric.device)
        real, computed = self.fabric.all_reduce(counts, reduce_op="sum").tolist()
        rows, tokens = real[:2]

        def mfu(counted):
            flops = self.flops_of(*counted) if self.flops_of else None
            return flops / seconds / (peak * self.fabric.world_size) if peak and flops is not None else None
        return {"train_time_s": seconds, "train_samples_per_s": rows / seconds,
                **({"train_tokens_per_s": tokens / seconds} if self.sized else {}),
                "mfu": mfu(real), "mfu_padded": mfu(computed), "recompiles_after_warm_up": self.recompiles()}
