"""Hand over the best model: its full weights, gathered from any strategy's checkpoint, written by the task."""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from fabric_utils import strategy
from fabric_utils.checkpoint import holds_trained_only
from fabric_utils.checkpoint_io import frozen_weights
from fabric_utils.private import _load_distributed_checkpoint


def full_state_dict(state_path: Path) -> dict:
    """The model's full weights from a ``fabric.save`` checkpoint: one file (single device, DDP), or FSDP's and
    FSDP2's shards."""
    if state_path.is_file():
        return torch.load(state_path, map_location="cpu", weights_only=True)["model"]
    return _load_distributed_checkpoint(state_path)["model"]


def export_model(fabric, best_state: Path, out: Path, model: torch.nn.Module, fingerprint: dict,
                 write: Callable[[dict, torch.nn.Module, Path], None] | None = None) -> None:
    """On rank 0, the task's ``write(weights, model, folder)``, else ``model.pt`` and the fingerprint's ``config.json``,
    into a folder then renamed to ``out``; the frozen weights a trained-only checkpoint leaves out come from ``model``."""
    frozen = frozen_weights(fabric, model) if holds_trained_only(best_state.parent) else {}
    if fabric.is_global_zero:
        tmp = out.with_name(f".tmp-{out.name}")
        _remove(tmp)
        tmp.mkdir(parents=True)
        engine = strategy.engine(fabric)
        weights = {**frozen, **(engine.full_state_dict(best_state) if engine else full_state_dict(best_state))}
        if write is not None:
            write(weights, model, tmp)
        else:
            torch.save(weights, tmp / "model.pt")
            (tmp / "config.json").write_text(json.dumps(fingerprint, indent=2))
        _remove(out)
        tmp.rename(out)
    fabric.barrier()


def _remove(path: Path) -> None:
    """A folder, or a link or file in its place (not what a link points at)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)
