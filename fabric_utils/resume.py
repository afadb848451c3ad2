"""A resume (``--resume``): the checkpoint to continue, agreed by every rank, and the training state restored from it
with this rank's random streams; loaded only when ``--resume`` asks."""

import contextlib
import json
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint import CheckpointException

from fabric_utils import strategy
from fabric_utils.checkpoint import (FINGERPRINT, ROWS_PER_STEP, TRAINED_ONLY, damage, read_record, step_checkpoints,
                                     with_loss_scaler)
from fabric_utils.checkpoint_io import read_state
from fabric_utils.errors import UserError, first_line
from fabric_utils.progress import say
from fabric_utils.safe_pickle import load_torch_file, refusal


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
        refused = refusal(found) if found else None
    chosen, refused = fabric.broadcast((None if found is None else str(found), refused))
    if refused:
        raise UserError(refused)
    if chosen is None:
        return None
    if damage(Path(chosen), contents=False):
        raise UserError(f"cannot resume: rank 0 resumes from {chosen}, which rank {fabric.global_rank} does not see "
                        f"whole; give every node the same --out-dir on a shared file system", rank=fabric.global_rank)
    return Path(chosen)


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
    try:
        read_state(fabric, path / "state", target, trained_only=bool(record.get(TRAINED_ONLY)))
    except (Exception, CheckpointException) as err:  # the latter, a BaseException, holds each rank's error
        cause = next(iter(err.failures.values()), (err,))[0] if isinstance(err, CheckpointException) else err
        raise UserError(f"cannot restore checkpoint {path}: {first_line(cause)[:300]} (is it from another model or "
                        f"label set, or damaged? start a new --out-dir or pass another --resume)") from err
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


def set_rng_state(state: dict) -> None:
    version, py_state, py_gauss = state["python"]
    random.setstate((version, tuple(py_state), py_gauss))
    key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state(("MT19937", key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
