"""What a user watches and finds after a run: the run folder, loggers, progress, environment report, plots."""

import os
import platform
import sys
import time
from datetime import datetime
from pathlib import Path

import torch
import yaml
from lightning.fabric.loggers import CSVLogger, TensorBoardLogger

from fabric_utils.errors import UserError

RUN_DIR_ENV = "FABRIC_TEMPLATE_RUN_DIR"


def prepare_out_dir(out_dir: str | None) -> Path:
    """The run folder: ``--out-dir``, else a new ``runs/<time>``. The name goes into the environment so processes
    that Fabric starts from this one pick the same folder (the loop later broadcasts rank 0's choice anyway)."""
    if out_dir is None:
        out_dir = os.environ.setdefault(RUN_DIR_ENV, f"runs/{datetime.now():%Y%m%d-%H%M%S}")
    path = Path(out_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise UserError(f"cannot write to output folder {path} ({err.strerror}); pass a writable --out-dir") from err
    return path


def make_loggers(names: str, out_dir: Path) -> list:
    """Fabric's own loggers, writing under the run folder: ``logs/version_N/metrics.csv`` and/or TensorBoard event
    files. Each start of the run (a resume too) gets a new version, so no earlier log is overwritten."""
    make = {"csv": lambda: CSVLogger(out_dir, name="logs"),
            "tensorboard": lambda: TensorBoardLogger(out_dir, name="tensorboard")}
    return [make[name]() for name in names.split(",")]


def quiet_libraries(fabric, quiet: bool) -> None:
    """Progress bars of datasets and transformers only on rank 0, and none with ``--quiet``."""
    if quiet or not fabric.is_global_zero:
        import datasets
        import transformers
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()


def environment_report(fabric) -> dict:
    import datasets
    import lightning
    import transformers
    try:
        import deepspeed
        deepspeed_version = deepspeed.__version__
    except Exception:  # deepspeed may be missing, or fail to import without a CUDA toolkit
        deepspeed_version = None
    if fabric.device.type == "cuda":
        device = {"cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                  "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    else:
        device = {"cpu": _cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    return {
        "python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
        "lightning": lightning.__version__, "transformers": transformers.__version__,
        "datasets": datasets.__version__, "deepspeed": deepspeed_version, **device,
        "world_size": fabric.world_size, "num_nodes": getattr(fabric.strategy, "num_nodes", 1),
        "strategy": type(fabric.strategy).__name__, "precision": fabric.strategy.precision.precision,
        "accelerator": type(fabric.accelerator).__name__,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def save_config(fabric, args, out_dir: Path) -> None:
    """The resolved flags as ``config.yaml``: ``--config`` reruns it, flags given beside it win."""
    if fabric.is_global_zero:
        (out_dir / "config.yaml").write_text(yaml.safe_dump(vars(args), sort_keys=False))


class Progress:
    """Rank 0's view of training: a tqdm bar on a terminal, plain log lines otherwise (CI, cluster logs).

    Loss and accuracy are summed on the device and read back only at log steps, so the hot loop never waits."""

    def __init__(self, fabric, total_steps: int, quiet: bool):
        self.fabric = fabric
        self.loss_sum = self.correct = self.seen = 0
        self.bar = None
        self.enabled = fabric.is_global_zero and not quiet
        self.last_line = time.perf_counter()
        if self.enabled and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, desc="train", dynamic_ncols=True)

    def accumulate(self, loss, logits, labels) -> None:
        self.loss_sum = self.loss_sum + loss * len(labels)
        self.correct = self.correct + (logits.argmax(-1) == labels).sum()
        self.seen += len(labels)

    def log(self, step: int, lr: float) -> dict:
        """Loss and accuracy since the last log over all ranks: every rank gets the same numbers, so a check on
        them (a non-finite loss) stops all ranks together instead of leaving the others waiting in a collective."""
        sums = torch.stack([torch.as_tensor(x, dtype=torch.float32, device=self.fabric.device)
                            for x in (self.loss_sum, self.correct, self.seen)])
        loss_sum, correct, seen = self.fabric.all_reduce(sums, reduce_op="sum").tolist()  # syncs: log steps only
        metrics = {"train/loss": loss_sum / max(seen, 1), "train/acc": correct / max(seen, 1), "lr": lr}
        self.fabric.log_dict(metrics, step=step)
        self.loss_sum = self.correct = self.seen = 0
        self.step, self.metrics = step, metrics
        return metrics

    def show(self, throughput: dict) -> None:
        if not self.enabled:
            return
        shown = {"loss": f"{self.metrics['train/loss']:.4f}", "acc": f"{self.metrics['train/acc']:.3f}",
                 "lr": f"{self.metrics['lr']:.2e}"}
        # the monitor reports rates once its window is full; "samples_per_sec" (all ranks) only with several
        samples_per_sec = throughput.get("samples_per_sec", throughput.get("device/samples_per_sec"))
        if samples_per_sec is not None:
            shown["samples/s"] = f"{samples_per_sec:.1f}"
        if self.bar is not None:
            self.bar.n = self.step
            self.bar.set_postfix(shown, refresh=True)
        else:
            print(f"step {self.step}: " + ", ".join(f"{k} {v}" for k, v in shown.items()), flush=True)


def plot_metrics(out_dir: Path) -> list[Path]:
    """Loss and accuracy curves (train and validation against step) from every ``metrics.csv`` of the run (a
    resumed run has one per start), as PNG files."""
    csvs = sorted(out_dir.glob("logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    if not csvs:
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    frames = []
    for csv in csvs:  # a resumed run logs again from its checkpoint's step: the later log wins from there on
        frame = pd.read_csv(csv)
        frames = [f[f["step"] < frame["step"].min()] for f in frames] + [frame]
    metrics = pd.concat(frames)
    written = []
    for name in ("loss", "acc"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for split in ("train", "val"):
            column = f"{split}/{name}"
            if column in metrics:
                points = metrics[["step", column]].dropna()
                ax.plot(points["step"], points[column], marker="o" if split == "val" else None, label=split)
        ax.set(xlabel="optimizer step", ylabel=name, title=f"{name} per step")
        ax.legend()
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
