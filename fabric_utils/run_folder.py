"""The run folder and what a run records about itself: its flags (config.yaml) and its environment."""

import contextlib
import csv
import fcntl
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import tempfile
from datetime import datetime
from pathlib import Path

import torch
import yaml

from fabric_utils import strategy
from fabric_utils.errors import UserError
from fabric_utils.loggers import start_trackers
from fabric_utils.progress import say

RUN_DIR_ENV = "FABRIC_TEMPLATE_RUN_DIR"
LOCK_FILE = ".lock"


RUN_FILES = ("config.yaml", "results.json", "checkpoints", "logs")  # what marks a folder as a run's
KEPT = ("results.json", "checkpoints")  # what makes a failed run's folder worth keeping


def prepare_out_dir(out_dir: str | None, resume: str | None) -> tuple[Path, bool]:
    """The run folder this process proposes, and whether a failed start may remove it: ``--out-dir``, checked now,
    else ``runs/<time>`` (in the environment, for the processes Fabric starts). A run's folder takes only
    ``--resume``; one holding files not a run's is refused."""
    if out_dir is None:
        path = Path(os.environ.setdefault(RUN_DIR_ENV, f"runs/{datetime.now():%Y%m%d-%H%M%S}"))
        check_writable(path.parent)
        return path, True
    path = Path(out_dir)
    held = sorted(p.name for p in path.iterdir() if p.name != LOCK_FILE) if path.is_dir() else []
    if held and not any(name in RUN_FILES for name in held):
        raise UserError(f"--out-dir {path} holds files that are not a run's ({', '.join(held[:3])}"
                        f"{', ...' if len(held) > 3 else ''}); pass a new or empty --out-dir")
    if resume is None and any((path / name).exists() for name in KEPT):
        raise UserError(f"--out-dir {path} holds a run already; continue it with --resume auto, or pass a new "
                        f"--out-dir")
    created = not path.exists()
    check_writable(path)
    return path, created


@contextlib.contextmanager
def proposed_run_folder(out_dir: str | None, resume: str | None, temporary: bool = False):
    """``prepare_out_dir``'s folder, removed after a failed start that made it; ``temporary``: removed at the end."""
    made = None
    if temporary and RUN_DIR_ENV not in os.environ:
        made = os.environ[RUN_DIR_ENV] = tempfile.mkdtemp(prefix="fabric-template-check-")
    path, created = prepare_out_dir(out_dir, resume=resume)
    try:
        yield path
    finally:
        if created:
            remove_if_unused(path)
        if made:
            shutil.rmtree(made, ignore_errors=True)
            say(f"--fast-dev-run: removed its folder {made}")


def check_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise UserError(f"cannot write to output folder {folder} ({err.strerror}); pass a writable --out-dir") from err


@contextlib.contextmanager
def locked_run_folder(fabric, proposed: Path):
    """Rank 0's proposed folder, locked by rank 0 for the run's life; the OS drops the lock with a killed process."""
    out_dir = Path(fabric.broadcast(str(proposed)))
    path, lock = out_dir / LOCK_FILE, None
    if fabric.is_global_zero:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = _lock(path)
    if not fabric.broadcast(lock is not None):
        raise UserError(f"another run is using --out-dir {out_dir} right now; let it finish, or pass another --out-dir")
    try:
        yield out_dir
    finally:
        if lock is not None:
            path.unlink()  # before the lock goes: a run starting now locks a new file
            lock.close()


def _lock(path: Path):
    """``path`` opened and locked, or None where another process holds it; again if a run just ended removed it."""
    while True:
        lock = open(path, "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            return None
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
                return lock
        lock.close()


def remove_if_unused(path: Path) -> None:
    """Removes a failed start's folder unless it holds checkpoints or results: it would block the same command."""
    if path.is_dir() and not any((path / name).exists() for name in KEPT):
        shutil.rmtree(path)


def package_version(name: str) -> str | None:
    """Without importing it (some probe for CUDA as they load)."""
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(name)
    return None


def environment_report(fabric) -> dict:
    if fabric.device.type == "cuda":
        device = {"cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                  "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    else:
        device = {"cpu": _cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    return {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
            **{name: package_version(name) for name in ("lightning", "transformers", "datasets", "peft",
                                                        *strategy.libraries(fabric))},
            **device, "world_size": fabric.world_size, "num_nodes": getattr(fabric.strategy, "num_nodes", 1),
            "strategy": type(fabric.strategy).__name__, "precision": fabric.strategy.precision.precision,
            "accelerator": type(fabric.accelerator).__name__}


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def save_config(fabric, args, out_dir: Path, environment: dict, resumed_at: int | None = None) -> None:
    """``config.yaml`` (``--config`` reruns it) and ``environment.json``, a resume's named ``-resumed-at-step-N``;
    then starts the tracked runs."""
    if fabric.is_global_zero:
        segment = "" if resumed_at is None else f"-resumed-at-step-{resumed_at:06d}"
        (out_dir / f"config{segment}.yaml").write_text(yaml.safe_dump(vars(args), sort_keys=False))
        (out_dir / f"environment{segment}.json").write_text(json.dumps(environment, indent=1))
    start_trackers(fabric, out_dir)


def write_predictions(path: Path, columns: dict) -> None:
    """``columns`` (name -> a tensor or a list, a row each) as CSV; a vector as one space-separated cell."""
    cells = [column.tolist() if isinstance(column, torch.Tensor) else column for column in columns.values()]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for row in zip(*cells):
            writer.writerow(" ".join(map(str, value)) if isinstance(value, list) else value for value in row)
