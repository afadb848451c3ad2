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
from torch.distributed.checkpoint import CheckpointException

from fabric_utils import strategy
from fabric_utils.checkpoint_io import (check_space, folder_bytes, read_state, say_disk_plan, stage, start,
                                        wait_for_save)
from fabric_utils.errors import UserError, first_line
from fabric_utils.progress import say
from fabric_utils.safe_pickle import check_folder, load_torch_file

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


def set_rng_state(state: dict) -> None:
    version, py_state, py_gauss = state["python"]
    random.setstate((version, tuple(py_state), py_gauss))
    key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state(("MT19937", key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


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
    previous = final if final.exists() else next(reversed(step_checkpoints(root)), None)
    nbytes = check_space(fabric, root, tag, staged.nbytes, previous if tag.startswith("step-") or final.exists()
                         else None)
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        with _deepspeed_weights_only(fabric, state):
            finish = staged.write(tmp / "state", background)
        torch.save(rng_state(), tmp / f"rng-rank{fabric.global_rank}.pt")
    except OSError as err:
        raise _disk_full(root, tmp, tag, err) from err
    fabric.barrier()  # every rank's files begun, its RNG streams written
    record = {"world_size": fabric.world_size, FINGERPRINT: state.get(FINGERPRINT), TRAINED_ONLY: staged.trained_only}

    def commit() -> None:  # rank 0, once the last file has landed
        try:
            (tmp / RECORD).write_text(json.dumps(record))
            write_manifest(tmp)
        except OSError as err:
            raise _disk_full(root, tmp, tag, err) from err
        old = root / f".old-{tag}"
        if final.exists():  # "best": the old copy goes only once the new is in place
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        if keep_last:
            for stale in step_checkpoints(root)[:-keep_last]:
                if stale != final:
                    shutil.rmtree(stale)

    def land() -> None:  # the rest of this rank's write
        try:
            finish()
        except OSError as err:
            raise _disk_full(root, tmp, tag, err) from err

    start(fabric, land, commit, background)
    if not background:
        wait_for_save(fabric)
    if tag.startswith("step-") and not _SAID_DISK_PLAN and fabric.is_global_zero:
        _SAID_DISK_PLAN.append(tag)
        say_disk_plan(root, tag, nbytes or folder_bytes(final), keep_last, state["model"], staged.trained_only)
    return final


_SAID_DISK_PLAN = []  # the step checkpoint whose line said what the run's checkpoints take: the first


def _disk_full(root: Path, tmp: Path, tag: str, err: OSError) -> Exception:
    """A full disk as one line, the unfinished checkpoint removed; any other error as it is."""
    if err.errno != errno.ENOSPC:
        return err
    shutil.rmtree(tmp, ignore_errors=True)  # the space it took, back
    intact = step_checkpoints(root)
    return UserError(f"the disk under {root} is full: checkpoint {tag} was not written; the newest intact one is "
                     f"{intact[-1] if intact else 'none'}. Free space (or pass --keep-last 1), then rerun with "
                     f"--resume auto")


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


@contextlib.contextmanager
def _deepspeed_weights_only(fabric, state: dict):
    """DeepSpeed writes its optimizer whatever ``state`` holds: without one (``best``), leave out Adam's moments."""
    if not strategy.uses_deepspeed(fabric):
        yield
        return
    from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, OPTIMIZER_STATE_DICT
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer

    optimizer = fabric.strategy.model.optimizer  # the engine's ZeRO optimizer
    if any(isinstance(obj, (torch.optim.Optimizer, DeepSpeedOptimizer)) for obj in state.values()):
        yield
        return
    full = optimizer.state_dict

    def without_moments() -> dict:
        written = {k: v for k, v in full().items() if k != BASE_OPTIMIZER_STATE}
        if OPTIMIZER_STATE_DICT in written:
            written[OPTIMIZER_STATE_DICT] = {**written[OPTIMIZER_STATE_DICT], "state": {}}  # load_weights reads it
        return written

    optimizer.state_dict = without_moments
    try:
        yield
    finally:
        del optimizer.state_dict  # the class's own again


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
        written = read_manifest(path)
    except OSError:
        return f"its {MANIFEST} is missing or cannot be read"
    except ValueError as err:
        return f"its {MANIFEST} is not as written: {first_line(err)[:200]}"
    folder = path.resolve()
    found = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} - {MANIFEST}
    for name, (size, digest) in written.items():
        file = path / name
        try:
            if not file.resolve().is_relative_to(folder):
                return f"its {MANIFEST} names {name}, outside the checkpoint"
            if not file.is_file():
                return f"{name} is missing"
            if (on_disk := file.stat().st_size) != size:
                return f"{name} has {on_disk} bytes, not the {size} written"
            if contents and _sha256(file) != digest:
                return f"{name} is not the file written (its SHA-256 differs)"
        except (OSError, RuntimeError) as err:  # the latter: a symlink loop
            return f"its {MANIFEST} names {name}, which cannot be read ({first_line(err)[:100]})"
    if extra := sorted(found - written.keys()):
        return f"{extra[0]} was not written with it"
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


def read_manifest(path: Path) -> dict[str, tuple[int, str]]:
    """Checkpoint ``path``'s manifest, name -> (bytes, SHA-256); a ValueError saying what is not as written."""
    files = _read_json(path / MANIFEST)
    if not isinstance(files, dict):
        raise ValueError(f"it holds a {type(files).__name__}, not a file per name")
    written = {}
    for name, entry in files.items():
        size, digest = (entry.get("bytes"), entry.get("sha256")) if isinstance(entry, dict) else (None, None)
        parts = Path(name).parts
        if (not name or "\0" in name or Path(name).is_absolute() or ".." in parts
                or any(len(part.encode()) > 255 for part in parts)):
            raise ValueError(f"it names {name[:100]!r}, not a file inside the checkpoint")
        if type(size) is not int or size < 0 or not isinstance(digest, str) or not re.fullmatch("[0-9a-f]{64}", digest):
            raise ValueError(f"its entry for {name[:100]!r} is not a size in bytes and a SHA-256")
        written[name] = size, digest
    return written


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


def find_resume_checkpoint(resume: str | None, root: Path, report: Callable[[str], None] = print) -> Path | None:
    """``--resume``: None, a checkpoint folder, or auto: the newest whole step checkpoint under ``root``."""
    if resume is None:
        return None
    if resume == "auto":
        for old in root.glob(".old-*"):  # a "best" whose replacement stopped between its two renames
            final = root / old.name[len(".old-"):]
            if not final.exists() and damage(old) is None:
                with contextlib.suppress(OSError):  # another process got there first
                    old.rename(final)
        for path in reversed(step_checkpoints(root, report)):
            if (problem := damage(path)) is None:
                return path
            report(f"skipping damaged checkpoint {path}: {problem}")
        return None
    path = Path(resume)
    if not (path / "state").exists():
        raise UserError(f"--resume {resume} is not a checkpoint folder (expected {path}/state); pass auto or a "
                        f"folder like <out-dir>/checkpoints/step-000100")
    if problem := damage(path):
        raise UserError(f"--resume {resume} is damaged: {problem}; pass another checkpoint, or auto")
    return path


def agreed_resume_checkpoint(fabric, resume: str | None, root: Path,
                             report: Callable[[str], None] = print) -> Path | None:
    """``find_resume_checkpoint`` as rank 0 sees it, on every rank: nodes can list the folder differently."""
    found, refused = None, None
    if fabric.is_global_zero:
        found = find_resume_checkpoint(resume, root, report)
        refused = _refusal(found) if found else None
    chosen, refused = fabric.broadcast((None if found is None else str(found), refused))
    if refused:
        raise UserError(refused)
    if chosen is None:
        return None
    if damage(Path(chosen), contents=False):
        raise UserError(f"cannot resume: rank 0 resumes from {chosen}, which rank {fabric.global_rank} does not see "
                        f"whole; give every node the same --out-dir on a shared file system", rank=fabric.global_rank)
    return Path(chosen)


def _refusal(folder: Path) -> str | None:
    try:
        check_folder(folder)
    except UserError as err:
        return str(err)
    return None


def verify(fabric, folder: Path) -> None:
    """Refuses, on every rank, a checkpoint that changed since it was written or that could run code."""
    refused = None
    if fabric.is_global_zero:
        problem = damage(folder)
        refused = f"checkpoint {folder} is damaged: {problem}" if problem else _refusal(folder)
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


def load_checkpoint(fabric, path: Path, state: dict, expected_fingerprint: dict | None = None) -> None:
    """Restores ``state`` in place, and this rank's RNG streams; refuses first another fingerprint or world size."""
    record = read_record(path)
    if expected_fingerprint is not None:  # as the record holds it: lists, not tuples
        _check_fingerprint(path, record.get(FINGERPRINT), json.loads(json.dumps(expected_fingerprint)))
    written_by = record["world_size"]
    reshards = (path / "state").is_file() or strategy.reshards_checkpoints(fabric)
    if written_by != fabric.world_size and not reshards:
        raise UserError(f"checkpoint {path} holds the shards of {written_by} processes, which "
                        f"{type(fabric.strategy).__name__} cannot reshard for {fabric.world_size}: resume on "
                        f"{written_by} (ddp and fsdp2 checkpoints resume on any number of devices)")
    target = with_loss_scaler(fabric, state)
    live = {key: obj for key, obj in target.items() if hasattr(obj, "load_state_dict")}
    try:
        read_state(fabric, path / "state", target, trained_only=bool(record.get(TRAINED_ONLY)))
    except (Exception, CheckpointException) as err:  # the latter, a BaseException, holds each rank's error
        cause = next(iter(err.failures.values()), (err,))[0] if isinstance(err, CheckpointException) else err
        raise UserError(f"cannot restore checkpoint {path}: {first_line(cause)[:300]} (is it from another model or "
                        f"label set, or damaged? start a new --out-dir or pass another --resume)") from err
    for key, obj in live.items():
        if target[key] is not obj:  # sharded loads hand the scheduler back as a state_dict
            obj.load_state_dict(target[key])
            target[key] = obj
    _check_restored(path, state, target)
    state.update({key: target[key] for key in state})
    rng_file = path / f"rng-rank{fabric.global_rank}.pt"
    if rng_file.exists():  # a rank the writing run did not have keeps its seeded streams
        try:
            rng = load_torch_file(rng_file)
        except UserError as err:
            raise UserError(str(err), rank=fabric.global_rank) from err
        set_rng_state(rng)


def _check_restored(path: Path, before: dict, restored: dict) -> None:
    """Refuses plain values that came back as another type, and counts that came back negative."""
    for key, old in before.items():
        new = restored.get(key)
        if type(old) in (int, float, str, list, dict) and (type(new) is not type(old)
                                                          or type(old) is int and old >= 0 > new):
            raise UserError(f"cannot restore checkpoint {path}: its {key} is {str(new)[:100]}, where this run has "
                            f"{'a count' if type(old) is int else f'a {type(old).__name__}'}; pass another --resume "
                            f"or start a new --out-dir")


def _same_value(a, b) -> bool:
    """Equal, or two spellings of one local path."""
    if isinstance(a, str) and isinstance(b, str) and a != b:
        try:
            pa, pb = Path(a).expanduser(), Path(b).expanduser()
            return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()
        except (OSError, ValueError, RuntimeError):  # not a path: a NUL, an unknown ~user, a symlink loop
            return False
    return a == b


def _check_fingerprint(path: Path, found, expected: dict) -> None:
    if not isinstance(found, dict):
        raise UserError(f"checkpoint {path} has no readable record of its task; start a new --out-dir or pass "
                        f"another --resume")
    differ = sorted(k for k in {*found, *expected} if not _same_value(found.get(k), expected.get(k)))
    if differ:
        changes = ", ".join(f"{k[:100]} {str(found.get(k))[:100]} (now {expected.get(k)})" for k in differ[:5])
        raise UserError(f"checkpoint {path} was written with {changes}; resume with the same flags, or start a new "
                        f"--out-dir")


def keep_rows_per_step(fabric, batch_size: int, grad_accum: int, checkpoint: Path | None) -> int:
    """The --grad-accum that keeps ``checkpoint``'s rows per optimizer step on this many devices."""
    if checkpoint is None:
        return grad_accum
    record = read_record(checkpoint)
    written_by, rows = record["world_size"], (record.get(FINGERPRINT) or {}).get(ROWS_PER_STEP)
    if written_by == fabric.world_size:
        return grad_accum
    if rows is None:
        raise UserError(f"checkpoint {checkpoint} does not record its rows per optimizer step: resume it on "
                        f"{written_by} devices")
    rows_per_batch = batch_size * fabric.world_size
    if rows % rows_per_batch:
        fix = (f"pass a --batch-size that divides {rows // fabric.world_size}" if rows % fabric.world_size == 0
               else f"resume on a number of devices that divides {rows}")
        raise UserError(f"cannot continue {rows} rows per optimizer step on {fabric.world_size} devices with "
                        f"--batch-size {batch_size}: {fix}")
    say(f"resuming with world size {fabric.world_size} instead of {written_by}: --grad-accum "
        f"{rows // rows_per_batch} keeps {rows} rows per optimizer step")
    return rows // rows_per_batch


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
