"""Atomic, verified checkpoints through ``fabric.save`` / ``fabric.load``: a folder of ``state``, ``rng-rank<r>.pt``,
``record.json`` and ``manifest.json`` (sizes and SHA-256), written as ``.tmp-*`` and renamed once every rank is done."""

import contextlib
import errno
import hashlib
import json
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from fabric_utils import strategy
from fabric_utils.checkpoint_io import (check_space, folder_bytes, read_state, say_disk_plan, stage, start,
                                        wait_for_save)
from fabric_utils.errors import UserError, first_line
from fabric_utils.safe_pickle import refusal

STEP_PATTERN = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"
RECORD = "record.json"
FINGERPRINT = "fingerprint"
TRAINED_ONLY = "trained_only"  # a record key: the state lacks the frozen parameters
ROWS_PER_STEP = "rows per optimizer step (--batch-size x devices x --grad-accum)"  # a fingerprint key


def rng_state() -> dict:
    """Every random stream of this process, in types ``weights_only=True`` loads."""
    _, mt_key, mt_pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    return {"python": [version, list(py_state), py_gauss],
            "numpy": [torch.from_numpy(mt_key.astype(np.int64)), mt_pos, has_gauss, gauss],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def save_checkpoint(fabric, root: Path, tag: str, state: dict, keep_last: int | None = None,
                    background: bool = False) -> Path:
    """Writes ``root/tag`` atomically on all ranks, without frozen parameters; then keeps only the ``keep_last`` newest
    step checkpoints. ``background``: returns once the state is copied, the write going on (``wait_for_save``)."""
    wait_for_save(fabric)  # at most one save in flight
    final, tmp = root / tag, root / f".tmp-{tag}"
    if fabric.is_global_zero:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed mid-write
    fabric.barrier()
    staged = stage(fabric, with_loss_scaler(fabric, state))
    last = final if final.exists() or not tag.startswith("step-") else next(reversed(step_checkpoints(root)), None)
    nbytes = check_space(fabric, root, tag, staged.nbytes, last)
    with _one_line_if_disk_full(root, tmp, tag):
        tmp.mkdir(parents=True, exist_ok=True)
        engine = strategy.engine(fabric)
        with engine.without_adam_moments(fabric, state) if engine else contextlib.nullcontext():
            finish = staged.write(tmp / "state", background)
        torch.save(rng_state(), tmp / f"rng-rank{fabric.global_rank}.pt")
    fabric.barrier()  # every rank's files begun, its RNG streams written
    if tag.startswith("step-") and not _SAID_DISK_PLAN and fabric.is_global_zero:
        _SAID_DISK_PLAN.append(tag)  # an engine's size is known once written: its files are in ``tmp`` by now
        say_disk_plan(root, tag, nbytes or folder_bytes(tmp), keep_last, state["model"], staged.trained_only)
    record = {"world_size": fabric.world_size, FINGERPRINT: state.get(FINGERPRINT), TRAINED_ONLY: staged.trained_only}

    def land() -> None:  # in the writer's thread: the rest of this rank's write, then rank 0 commits it
        with _one_line_if_disk_full(root, tmp, tag):
            finish()
            if not fabric.is_global_zero:
                return
            (tmp / RECORD).write_text(json.dumps(record))
            write_manifest(tmp)
        old = root / f".old-{tag}"
        if final.exists():  # "best": the old copy goes only once the new is in place
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        if keep_last:
            for stale in step_checkpoints(root)[:-keep_last]:
                if stale != final:
                    shutil.rmtree(stale)

    start(land)
    if not background:
        wait_for_save(fabric)
    return final


_SAID_DISK_PLAN = []  # the step checkpoint whose line said what the run's checkpoints take: the first


@contextlib.contextmanager
def _one_line_if_disk_full(root: Path, tmp: Path, tag: str):
    """A full disk as one line, the unfinished checkpoint removed; any other error as it is."""
    try:
        yield
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # the space it took, back
        intact = step_checkpoints(root)
        raise UserError(f"the disk under {root} is full: checkpoint {tag} was not written; the newest intact one "
                        f"is {intact[-1] if intact else 'none'}. Free space (or pass --keep-last 1), then rerun with "
                        f"--resume auto") from err


def holds_trained_only(path: Path) -> bool:
    """Whether checkpoint ``path`` lacks the frozen parameters: the model it restores is built on its pretrained
    base."""
    return bool(read_record(path).get(TRAINED_ONLY))


def remove_checkpoint(path: Path) -> None:
    """Renamed first, so a kill midway leaves it whole or gone."""
    trash = path.with_name(f".tmp-{path.name}")  # what save_checkpoint clears before writing ``path`` again
    shutil.rmtree(trash, ignore_errors=True)
    path.rename(trash)
    shutil.rmtree(trash)


def with_loss_scaler(fabric, state: dict) -> dict:
    """``state`` plus the loss scaler Fabric leaves out: a resume at the first scale would skip steps."""
    return {**state, "loss_scaler": fabric.strategy.precision} if strategy.scales_loss(fabric) else state


def load_weights(fabric, path: Path, model) -> None:
    """A checkpoint's weights into ``model``; under ZeRO-3 with its optimizer, so each rank reads only its file."""
    verify(fabric, path.parent)
    state = {"model": model}
    if strategy.uses_zero3(fabric):
        state["optimizer"] = fabric.strategy.model.optimizer  # the engine's ZeRO optimizer
    read_state(fabric, path, state, trained_only=holds_trained_only(path.parent))


def write_manifest(folder: Path) -> None:
    files = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p != folder / MANIFEST}
    (folder / MANIFEST).write_text(json.dumps(files, indent=0))


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def damage(path: Path, contents: bool = True) -> str | None:
    """What is wrong with checkpoint folder ``path`` by its manifest (``contents``: hashes and the record's values
    too), or None."""
    try:
        written = _read_json(path / MANIFEST)
    except OSError:
        return f"its {MANIFEST} is missing or cannot be read"
    except ValueError as err:
        return f"its {MANIFEST} is not as written: {first_line(err)[:200]}"
    if not isinstance(written, dict) or not all(isinstance(entry, dict) and type(entry.get("bytes")) is int
                                                for entry in written.values()):
        return f"its {MANIFEST} is not a size in bytes and a SHA-256 per file"
    # names meet only the files found: one outside the folder, or no path at all, is missing
    found = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} - {MANIFEST}
    if missing := sorted(written.keys() - found):
        return f"{missing[0][:100]} is missing"
    if extra := sorted(found - written.keys()):
        return f"{extra[0]} was not written with it"
    folder = path.resolve()
    for name, entry in written.items():
        file = path / name
        try:
            if not file.resolve().is_relative_to(folder):
                return f"{name} links outside the checkpoint"
            if (on_disk := file.stat().st_size) != entry["bytes"]:
                return f"{name} has {on_disk} bytes, not the {entry['bytes']} written"
            if contents and _sha256(file) != entry.get("sha256"):
                return f"{name} is not the file written (its SHA-256 differs)"
        except OSError as err:
            return f"{name} cannot be read ({first_line(err)[:100]})"
    if contents:  # the record as written (by its hash), then its values
        try:
            read_record(path)
        except UserError:
            return f"its {RECORD} is not the one train.py writes"
    return None


MAX_RECORD_BYTES = 16 << 20  # manifest.json and record.json: kilobytes as written


def _read_json(file: Path):
    if (size := file.stat().st_size) > MAX_RECORD_BYTES:
        raise ValueError(f"it has {size} bytes")
    try:
        return json.loads(file.read_text())
    except RecursionError as err:
        raise ValueError("it nests too deep") from err


def step_checkpoints(root: Path, report: Callable[[str], None] | None = None) -> list[Path]:
    """Whole step checkpoints under ``root`` (by their manifests: hashes are checked on load), oldest first; ``report``
    is told of each damaged one."""
    found = []
    for path in sorted((p for p in root.glob("step-*") if p.is_dir() and STEP_PATTERN.match(p.name)),
                       key=lambda p: int(STEP_PATTERN.match(p.name).group(1))):
        problem = damage(path, contents=False)
        if problem is None:
            found.append(path)
        elif report:
            report(f"skipping damaged checkpoint {path}: {problem}")
    return found


def verify(fabric, folder: Path) -> None:
    """Refuses, on every rank, a checkpoint that changed since it was written or that could run code."""
    refused = None
    if fabric.is_global_zero:
        problem = damage(folder)
        refused = f"checkpoint {folder} is damaged: {problem}" if problem else refusal(folder)
    if refused := fabric.broadcast(refused):
        raise UserError(refused)


def read_record(path: Path) -> dict:
    """Checkpoint ``path``'s record, checked: a world size, and a fingerprint whose rows per step are a count."""
    try:
        record = _read_json(path / RECORD)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot restore checkpoint {path}: its {RECORD} cannot be read ({type(err).__name__}); "
                        f"pass another --resume or start a new --out-dir") from err
    fingerprint = record.get(FINGERPRINT) if isinstance(record, dict) else None
    rows = fingerprint.get(ROWS_PER_STEP, 1) if isinstance(fingerprint, dict) else 1
    if (not isinstance(record, dict) or not _count(record.get("world_size")) or not _count(rows)
            or not isinstance(fingerprint, (dict, type(None)))):
        raise UserError(f"cannot restore checkpoint {path}: its {RECORD} does not hold a world size and rows per "
                        f"optimizer step of 1 or more ({json.dumps(record)[:200]}); pass another --resume or start "
                        f"a new --out-dir")
    return record


def _count(value) -> bool:
    return type(value) is int and value >= 1


def load_best(fabric, out_dir: Path, model) -> Path | None:
    """Loads checkpoints/best into ``model`` and returns it; None where a finished run's resume found no better one."""
    best, results_file = out_dir / "checkpoints" / "best", out_dir / "results.json"
    if best.exists():
        load_weights(fabric, best / "state", model)
        return best
    if results_file.exists():
        return None
    raise UserError(f"{best} is gone (a finished run removes it: model/ holds its weights) and so is {results_file}: "
                    f"nothing is left to test; start a new --out-dir (or keep it next time with "
                    f"--keep-best-checkpoint)")


class BestRule(NamedTuple):
    """The validation metric that picks checkpoints/best, its direction ("max", "min" or the task's rule) and test."""
    metric: str
    direction: str
    is_better: Callable[[float, float | None], bool]

    def improves(self, val: dict, best: dict) -> bool:
        """Whether ``val`` beats ``best``; a tie goes to the lower loss, the model that went on learning."""
        if best and val[self.metric] == best[self.metric]:
            return val["loss"] < best["loss"]
        return self.is_better(val[self.metric], best.get(self.metric))


def best_rule(objective, choice: str | None) -> BestRule:
    """The task's rule, or ``choice``'s (--best-metric NAME[:max|min])."""
    if choice is None:
        direction = {True: "max", False: "min"}.get(getattr(objective, "higher_is_better", None), "the task's rule")
        return BestRule(objective.best_metric, direction, objective.is_better)
    name, _, direction = choice.partition(":")
    metrics = objective.make_metrics()
    if name != "loss" and name not in metrics:
        raise UserError(f"--best-metric {choice}: the validation metrics are {', '.join(['loss', *metrics])}")
    if not direction:
        higher = False if name == "loss" else getattr(metrics[name], "higher_is_better", None)
        if higher is None:
            raise UserError(f"--best-metric {name}: its direction is not known; pass {name}:max or {name}:min")
        direction = "max" if higher else "min"
    if direction not in ("max", "min"):
        raise UserError(f"--best-metric {choice}: the direction is max or min, got {direction}")
    return BestRule(name, direction,
                    lambda value, best: best is None or (value > best if direction == "max" else value < best))
