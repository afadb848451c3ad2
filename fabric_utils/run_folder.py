"""The run folder and what a run records about itself: its flags (config.yaml) and its environment."""

import importlib.metadata
import os
import platform
import sys
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


REPORTED_PACKAGES = ("torch", "lightning", "transformers", "datasets", "deepspeed", "peft")


def package_version(name: str) -> str | None:
    """Read from the installed metadata, without importing (deepspeed's import alone probes for CUDA)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment_report(fabric) -> dict:
    if fabric.device.type == "cuda":
        device = {"cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                  "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    else:
        device = {"cpu": _cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    return {
        "python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
        **{name: package_version(name) for name in REPORTED_PACKAGES if name != "torch"}, **device,
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
