"""Atomic, resumable checkpoints through ``fabric.save`` / ``fabric.load`` (so FSDP and DeepSpeed shard them): a folder
``step-000123`` with ``state``, ``rng-rank<r>.pt`` per rank, ``record.json`` (fingerprint and world size, read before
anything loads) and ``manifest.json`` (every file's size), written as ``.tmp-*`` and renamed once every rank is done;
``--resume auto`` takes the newest whose manifest still matches (a disk, a copy or a hand can damage one later)."""

import contextlib
import errno
import json
import pickle
import random
import re
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from lightning.fabric.strategies import DeepSpeedStrategy, ModelParallelStrategy

from fabric_utils.errors import UserError, first_line
from fabric_utils.launcher import scales_loss

STEP_PATTERN = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"
RECORD = "record.json"
FINGERPRINT = "fingerprint"


def rng_state() -> dict:
    """Every random stream of this process, as tensors and plain types so ``weights_only=True`` can load it."""
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


def save_checkpoint(fabric, root: Path, tag: str, state: dict, keep_last: int | None = None) -> Path:
    """Writes ``root/tag`` atomically on all ranks; then keeps only the ``keep_last`` newest step checkpoints."""
    final, tmp = root / tag, root / f".tmp-{tag}"
    if fabric.is_global_zero and tmp.exists():
        shutil.rmtree(tmp)  # left by a run killed mid-write
    fabric.barrier()
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        with _deepspeed_weights_only(fabric, state):
            fabric.save(tmp / "state", with_loss_scaler(fabric, state))
        torch.save(rng_state(), tmp / f"rng-rank{fabric.global_rank}.pt")
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # the space it took, back
        intact = step_checkpoints(root)
        raise UserError(f"the disk under {root} is full: checkpoint {tag} was not written; the newest intact one is "
                        f"{intact[-1] if intact else 'none'}. Free space (or pass --keep-last 1), then rerun with "
                        f"--resume auto") from err
    fabric.barrier()
    if fabric.is_global_zero:
        (tmp / RECORD).write_text(json.dumps({"world_size": fabric.world_size, FINGERPRINT: state.get(FINGERPRINT)}))
        write_manifest(tmp)
        old = root / f".old-{tag}"
        if final.exists():  # replace (only "best" is ever rewritten): the old copy goes only after the new is in place
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        if keep_last:  # never the one just written, whatever the folder's other names say
            for stale in step_checkpoints(root)[:-keep_last]:
                if stale != final:
                    shutil.rmtree(stale)
    fabric.barrier()
    return final


def with_loss_scaler(fabric, state: dict) -> dict:
    """``state`` plus, under 16-mixed, the loss scaler Fabric leaves out: a resume at the first scale would skip steps
    the uninterrupted run took (DeepSpeed keeps its own)."""
    return {**state, "loss_scaler": fabric.strategy.precision} if scales_loss(fabric) else state


@contextlib.contextmanager
def _deepspeed_weights_only(fabric, state: dict):
    """Under DeepSpeed, a checkpoint without an optimizer (``best``) keeps the fp32 weights but not Adam's moments,
    twice their size, which only a resume needs (DeepSpeed writes its optimizer whatever ``state`` holds)."""
    if not isinstance(fabric.strategy, DeepSpeedStrategy):
        yield
        return
    from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, OPTIMIZER_STATE_DICT
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer

    optimizer = fabric.strategy.model.optimizer  # the engine's ZeRO optimizer
    if any(isinstance(obj, (torch.optim.Optimizer, DeepSpeedOptimizer)) for obj in state.values()):
        yield
        return
    full = optimizer.state_dict  # where stages 1 and 2 (BASE_...) and stage 3 keep the moments

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
    """A checkpoint's weights into the set-up ``model``. ZeRO-3 loads its optimizer too, so each rank reads only its
    own file (the weights alone are built whole on every rank), which leaves the optimizer unfit for more steps."""
    state = {"model": model}
    if isinstance(fabric.strategy, DeepSpeedStrategy) and fabric.strategy.zero_stage_3:
        state["optimizer"] = fabric.strategy.model.optimizer  # the engine's ZeRO optimizer
    fabric.load(path, state)


def write_manifest(folder: Path) -> None:
    files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}
    (folder / MANIFEST).write_text(json.dumps(files, indent=0))


def damage(path: Path) -> str | None:
    """What is wrong with checkpoint folder ``path`` by its manifest, or None."""
    try:
        files = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"its {MANIFEST} is missing or cannot be read"
    for name, size in files.items():
        if not (path / name).is_file():
            return f"{name} is missing"
        if (found := (path / name).stat().st_size) != size:
            return f"{name} has {found} bytes, not the {size} written"
    return None


def step_checkpoints(root: Path, report: Callable[[str], None] | None = None) -> list[Path]:
    """Whole step checkpoints under ``root``, oldest first; ``report`` is told of each damaged one left out."""
    found = []
    for path in sorted((p for p in root.glob("step-*") if p.is_dir() and STEP_PATTERN.match(p.name)),
                       key=lambda p: int(STEP_PATTERN.match(p.name).group(1))):
        problem = damage(path)
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
        found = step_checkpoints(root, report)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / "state").exists():
        raise UserError(f"--resume {resume} is not a checkpoint folder (expected {path}/state); pass auto or a "
                        f"folder like <out-dir>/checkpoints/step-000100")
    if problem := damage(path):
        raise UserError(f"--resume {resume} is damaged: {problem}; pass another checkpoint, or auto")
    return path


def agreed_resume_checkpoint(fabric, resume: str | None, root: Path,
                             report: Callable[[str], None] = print) -> Path | None:
    """``find_resume_checkpoint`` as rank 0 sees it, on every rank: ranks that listed the folder each for themselves
    could pick different checkpoints (a node-local --out-dir, a network file system that shows new folders late)."""
    found = find_resume_checkpoint(resume, root, report) if fabric.is_global_zero else None
    chosen = fabric.broadcast(None if found is None else str(found))
    if chosen is None:
        return None
    if damage(Path(chosen)):
        raise UserError(f"cannot resume: rank 0 resumes from {chosen}, which rank {fabric.global_rank} does not see "
                        f"whole; give every node the same --out-dir on a shared file system", rank=fabric.global_rank)
    return Path(chosen)


def read_record(path: Path) -> dict:
    """A checkpoint's ``record.json``: ``world_size`` and ``fingerprint``."""
    try:
        return json.loads((path / RECORD).read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"cannot restore checkpoint {path}: its {RECORD} cannot be read ({type(err).__name__}); "
                        f"pass another --resume or start a new --out-dir") from err


def load_checkpoint(fabric, path: Path, state: dict, expected_fingerprint: dict | None = None) -> None:
    """Restores ``state`` in place from ``path``, and this rank's RNG streams; refuses first, before restoring anything,
    another fingerprint (not a cryptic shape error) or a world it cannot reshard."""
    record = read_record(path)
    if expected_fingerprint is not None:  # as the record holds it: lists, not tuples
        _check_fingerprint(path, record[FINGERPRINT], json.loads(json.dumps(expected_fingerprint)))
    written_by = record["world_size"]
    # one file (single device, DDP) and FSDP2's distributed checkpoint reshard on load; FSDP's, DeepSpeed's do not
    reshards = (path / "state").is_file() or isinstance(fabric.strategy, ModelParallelStrategy)
    if written_by != fabric.world_size and not reshards:
        raise UserError(f"checkpoint {path} holds the shards of {written_by} processes, which "
                        f"{type(fabric.strategy).__name__} cannot reshard for {fabric.world_size}: resume on "
                        f"{written_by} (ddp and fsdp2 checkpoints resume on any number of devices)")
    damaged = (f"cannot restore checkpoint {path}: its state file is damaged or was not written by train.py; pass "
               f"another --resume or start a new --out-dir")
    # torch.save writes a zip archive; unpickling other bytes fails with any error, not only UnpicklingError
    if (path / "state").is_file() and not zipfile.is_zipfile(path / "state"):
        raise UserError(damaged)
    target = with_loss_scaler(fabric, state)  # fabric.load restores it in place, in the plugin
    live = {key: obj for key, obj in target.items() if hasattr(obj, "load_state_dict")}
    try:
        fabric.load(path / "state", target, weights_only=True)
    except pickle.UnpicklingError as err:  # torch's own message suggests weights_only=False: not the fix for this
        raise UserError(damaged) from err
    except Exception as err:  # torch, safetensors and DeepSpeed each raise their own kinds for a bad file
        raise UserError(f"cannot restore checkpoint {path}: {first_line(err)[:300]} (is it from another model or "
                        f"label set, or damaged? start a new --out-dir or pass another --resume)") from err
    for key, obj in live.items():
        # sharded FSDP and FSDP2 loads hand back a stateful non-model, non-optimizer (scheduler) as a state_dict
        if target[key] is not obj:
            obj.load_state_dict(target[key])
            target[key] = obj
    state.update({key: target[key] for key in state})  # fabric.load wrote the plain values (step, ...) into target
    rng_file = path / f"rng-rank{fabric.global_rank}.pt"
    if rng_file.exists():  # a rank the writing run did not have keeps its seeded streams
        try:
            rng = torch.load(rng_file, weights_only=True)
        except Exception as err:
            raise UserError(f"cannot restore checkpoint {path}: its {rng_file.name} is damaged "
                            f"({type(err).__name__}); pass another --resume or start a new --out-dir",
                            rank=fabric.global_rank) from err
        set_rng_state(rng)


def _same_value(a, b) -> bool:
    """Equal, or two spellings (relative, absolute, ~) of one local path."""
    if isinstance(a, str) and isinstance(b, str) and a != b:
        pa, pb = Path(a).expanduser(), Path(b).expanduser()
        return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()
    return a == b


def _check_fingerprint(path: Path, found, expected: dict) -> None:
    """Refuses a checkpoint whose fingerprint is not ``expected``, naming each difference."""
    if not isinstance(found, dict):
        raise UserError(f"checkpoint {path} has no readable record of its task; start a new --out-dir or pass "
                        f"another --resume")
    differ = sorted(k for k in {*found, *expected} if not _same_value(found.get(k), expected.get(k)))
    if differ:
        changes = ", ".join(f"{k} {found.get(k)} (now {expected.get(k)})" for k in differ)
        raise UserError(f"checkpoint {path} was written with {changes}; resume with the same flags, or start a new "
                        f"--out-dir")
