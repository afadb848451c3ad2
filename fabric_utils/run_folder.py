"""The run folder and what a run records about itself: its flags (config.yaml) and its environment."""

import contextlib
import csv
import importlib.metadata
import itertools
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
from filelock import FileLock, Timeout
from lightning.fabric.utilities.rank_zero import rank_zero_only

from fabric_utils import strategy
from fabric_utils.args import RUN_MARKER
from fabric_utils.errors import UserError
from fabric_utils.loggers import start_trackers
from fabric_utils.progress import say

RUN_DIR_ENV = "FABRIC_TEMPLATE_RUN_DIR"
LOCK_FILE = ".lock"
KEPT = ("results.json", "checkpoints")  # what makes a failed run's folder worth keeping
_CHECKED = set()  # folders this process checked (or made) before writing: its trackers then write before the lock


def check_run_folder(path: Path, resume: str | None, foreign: bool = True) -> None:
    """Refuses a folder that holds files but no run (no ``RUN_MARKER``; ``foreign``: its files may be a user's), and,
    without ``--resume``, a run's that holds checkpoints or results."""
    held = sorted(p.name for p in path.iterdir() if p.name != LOCK_FILE) if path.is_dir() else []
    if foreign and held and RUN_MARKER not in held:
        raise UserError(f"--out-dir {path} holds files that are not a run's ({', '.join(held[:3])}"
                        f"{', ...' if len(held) > 3 else ''}); pass a new or empty --out-dir")
    if resume is None and any(name in KEPT for name in held):
        raise UserError(f"--out-dir {path} holds a run already; continue it with --resume auto, or pass a new "
                        f"--out-dir")


def _first_process() -> bool:
    """Whether the environment makes this process rank 0 (Lightning's launcher starts the other ranks from it)."""
    return rank_zero_only.rank == 0 and os.environ.get("NODE_RANK", "0") == "0"


def claim_out_dir(out_dir: str | None) -> tuple[Path, bool]:
    """The run folder this process proposes, and whether it made it (``mkdir``: atomic, so two starts in the same
    second never share a new folder): ``--out-dir``, else ``FABRIC_TEMPLATE_RUN_DIR`` (as Fabric's processes inherit
    it), else a new ``runs/<time>``; only the first process makes or checks one, the others take rank 0's."""
    if out_dir is None and RUN_DIR_ENV not in os.environ:
        base = Path(f"runs/{datetime.now():%Y%m%d-%H%M%S}")
        if not _first_process():
            return base, False
        for n in itertools.count(1):
            path = base if n == 1 else base.with_name(f"{base.name}-{n}")
            if _make(path):
                os.environ[RUN_DIR_ENV] = str(path)  # for the processes Fabric starts
                return path, True
    path = Path(out_dir or os.environ[RUN_DIR_ENV])
    return path, _first_process() and _make(path)


def _make(path: Path) -> bool:
    """Whether this process made folder ``path`` (False: it exists); one line where it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir()
        return True
    except FileExistsError:
        if path.is_dir() and os.access(path, os.W_OK | os.X_OK):
            return False
        reason = "it is a file" if path.exists() else "permission denied"
    except OSError as err:
        reason = err.strerror
    raise UserError(f"cannot write to output folder {path} ({reason}); pass a writable --out-dir")


@contextlib.contextmanager
def proposed_run_folder(out_dir: str | None, resume: str | None, temporary: bool = False):
    """``claim_out_dir``'s folder, checked now (the lock checks it again); removed after a start that made it if no
    run wrote into it; ``temporary``: removed at the end."""
    made = None
    if temporary and RUN_DIR_ENV not in os.environ:
        made = os.environ[RUN_DIR_ENV] = tempfile.mkdtemp(prefix="fabric-template-check-")
    path, created = claim_out_dir(out_dir)
    if _first_process():
        check_run_folder(path, resume)  # early, before the processes start
        _CHECKED.add(path.resolve())
    try:
        yield path
    finally:
        if created:
            with contextlib.suppress(OSError):  # only while empty: another run may have taken it since
                path.rmdir()
        if made:
            shutil.rmtree(made, ignore_errors=True)
            say(f"--fast-dev-run: removed its folder {made}")


@contextlib.contextmanager
def locked_run_folder(fabric, proposed: Path, resume: str | None):
    """Rank 0's proposed folder, locked by rank 0 for the run's life (the OS drops the lock with a killed process)
    and checked under the lock; a start that fails removes only what it wrote there, unless it checkpointed."""
    out_dir = Path(fabric.broadcast(str(proposed)))
    lock, refused, before = None, None, set()
    if fabric.is_global_zero:
        lock = FileLock(out_dir / LOCK_FILE, timeout=0, fallback_to_soft=False)  # flock: no stale lock outlives a run
        try:
            lock.acquire()
            check_run_folder(out_dir, resume, foreign=out_dir.resolve() not in _CHECKED)
            before = set(os.listdir(out_dir))
            if RUN_MARKER not in before:
                (out_dir / RUN_MARKER).write_text("a fabric-template run's folder: train.py --resume auto "
                                                  "continues it\n")
        except Timeout:  # before OSError, which it is
            refused = f"another run is using --out-dir {out_dir} right now; let it finish, or pass another --out-dir"
        except UserError as err:
            refused = str(err)
        except OSError as err:
            refused = f"cannot write to output folder {out_dir} ({err.strerror}); pass a writable --out-dir"
        if refused:
            _unlock(lock)
    if refused := fabric.broadcast(refused):
        raise UserError(refused)
    try:
        yield out_dir
    except BaseException:
        if lock is not None and not any((out_dir / name).exists() for name in KEPT):
            _remove_new(out_dir, before)
        raise
    finally:
        if lock is not None:
            _unlock(lock)


def _unlock(lock: FileLock) -> None:
    """Releases the lock if this process holds it, its file removed first: a run starting now locks a new one."""
    if lock.is_locked:
        Path(lock.lock_file).unlink(missing_ok=True)
        lock.release()


def _remove_new(folder: Path, before: set) -> None:
    """What a failed start added to ``folder`` (all of a folder it made), and nothing that was there before."""
    for name in set(os.listdir(folder)) - before - {LOCK_FILE}:
        entry = folder / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


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
