"""Atomic, resumable checkpoints through ``fabric.save`` / ``fabric.load`` (so FSDP and DeepSpeed shard them).

A checkpoint is a folder ``<root>/step-000123/`` holding ``state`` (a file, or a folder for sharded strategies) and
one ``rng-rank<r>.pt`` per rank. It is written as ``.tmp-step-000123`` and renamed only once every rank has
finished, so a folder without the ``.tmp-`` prefix is always complete; ``--resume auto`` never sees a partial one.
"""

import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from fabric_utils.errors import UserError

STEP_PATTERN = re.compile(r"^step-(\d+)$")


def rng_state() -> dict:
    """Every random stream of this process, as tensors and plain types so ``weights_only=True`` can load it."""
    _, mt_key, mt_pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    return {
        "python": [version, list(py_state), py_gauss],
        "numpy": [torch.from_numpy(mt_key.astype(np.int64)), mt_pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


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
    tmp.mkdir(parents=True, exist_ok=True)
    fabric.save(tmp / "state", state)
    torch.save(rng_state(), tmp / f"rng-rank{fabric.global_rank}.pt")
    fabric.barrier()
    if fabric.is_global_zero:
        old = root / f".old-{tag}"
        if final.exists():  # replace (only "best" is ever rewritten): the old copy goes only after the new is in place
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        if keep_last:
            for stale in step_checkpoints(root)[:-keep_last]:
                shutil.rmtree(stale)
    fabric.barrier()
    return final


def step_checkpoints(root: Path) -> list[Path]:
    """Complete step checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_PATTERN.match(p.name)]
    return sorted(found, key=lambda p: int(STEP_PATTERN.match(p.name).group(1)))


def find_resume_checkpoint(resume: str | None, root: Path) -> Path | None:
    if resume is None:
        return None
    if resume == "auto":
        found = step_checkpoints(root)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / "state").exists():
        raise UserError(f"--resume {resume} is not a checkpoint folder (expected {path}/state); pass auto or a "
                        f"folder like <out-dir>/checkpoints/step-000100")
    return path


def load_checkpoint(fabric, path: Path, state: dict, expected_meta: dict | None = None) -> dict:
    """Restores ``state`` in place from ``path`` and this rank's RNG streams; returns what was not restored in
    place. Refuses a checkpoint of another model or label set, and one that cannot be read, with a UserError."""
    try:
        remainder = fabric.load(path / "state", state, weights_only=True)
    except Exception as err:  # torch, safetensors and DeepSpeed each raise their own kinds for a bad file
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(f"cannot restore checkpoint {path}: {message[:300]} (is it from another model or "
                        f"label set, or damaged? start a new --out-dir or pass another --resume)") from err
    if expected_meta is not None and remainder.get("meta", state.get("meta")) != expected_meta:
        found = remainder.get("meta", state.get("meta"))
        raise UserError(f"checkpoint {path} was written for {found}, not {expected_meta}; resume with the same "
                        f"--model and data, or start a new --out-dir")
    rng_file = path / f"rng-rank{fabric.global_rank}.pt"
    if rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=True))
    return remainder
