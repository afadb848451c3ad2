"""What a user watches and finds after a run: the run folder, progress, environment report (loggers and plots:
``fabric_utils/loggers.py``)."""

import os
import platform
import sys
import time
from datetime import datetime
from pathlib import Path

import torch
import yaml

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
        metrics = {"train/loss": float(self.loss_sum) / max(self.seen, 1),
                   "train/acc": float(self.correct) / max(self.seen, 1), "lr": lr}
        self.fabric.log_dict(metrics, step=step)
        self.loss_sum = self.correct = self.seen = 0
        self.step, self.metrics = step, metrics
        return metrics

    def show(self, throughput: dict) -> None:
        if not self.enabled:
            return
        shown = {"loss": f"{self.metrics['train/loss']:.4f}", "acc": f"{self.metrics['train/acc']:.3f}",
                 "lr": f"{self.metrics['lr']:.2e}"}
        if "throughput/samples_per_sec" in throughput:
            shown["samples/s"] = f"{throughput['throughput/samples_per_sec']:.1f}"
        if self.bar is not None:
            self.bar.n = self.step
            self.bar.set_postfix(shown, refresh=True)
        else:
            print(f"step {self.step}: " + ", ".join(f"{k} {v}" for k, v in shown.items()), flush=True)
