"""Hand over the best model: its full weights, gathered from any strategy's checkpoint, written by the task."""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from fabric_utils.checkpoint_io import frozen_weights
from fabric_utils.private import _load_distributed_checkpoint


def full_state_dict(state_path: Path) -> dict:
    """The model's full weights from a ``fabric.save`` checkpoint of any strategy."""
    if state_path.is_file():  # single device, DDP
        return torch.load(state_path, map_location="cpu", weights_only=True)["model"]
    if not ((state_path / "latest").exists() or any(state_path.glob("*/mp_rank_*"))):
        return _load_distributed_checkpoint(state_path)["model"]  # FSDP's and FSDP2's shards
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # ZeRO's fp32 master weights, plus the frozen ones (LoRA's base) it leaves out, whole in its module file
    weights = get_fp32_state_dict_from_zero_checkpoint(str(state_path), tag="checkpoint")
    module_file = min((state_path / "checkpoint").glob("*model_states.pt"))  # ZeRO-3 writes one per rank
    module = torch.load(module_file, map_location="cpu", weights_only=True, mmap=True)["module"]
    weights.update({name: module[name] for name in module.keys() - weights.keys()})
    return weights


def export_model(fabric, best_state: Path, out: Path, model: torch.nn.Module, fingerprint: dict,
                 write: Callable[[dict, torch.nn.Module, Path], None] | None = None) -> None:
    """On rank 0, the task's ``write(weights, model, folder)``, else ``model.pt`` and the fingerprint's ``config.json``,
    into a folder then renamed to ``out``; the frozen weights a checkpoint leaves out come from ``model``."""
    frozen = frozen_weights(fabric, model)
    if fabric.is_global_zero:
        tmp = out.with_name(f".tmp-{out.name}")
        _remove(tmp)
        tmp.mkdir(parents=True)
        weights = {**frozen, **full_state_dict(best_state)}
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
