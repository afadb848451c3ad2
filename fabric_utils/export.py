"""Hand over the best model: its full weights, gathered from any strategy's checkpoint, written by the task."""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from fabric_utils.private import _load_distributed_checkpoint


def full_state_dict(state_path: Path) -> dict:
    """The model's full, unsharded weights from a ``fabric.save`` checkpoint of any strategy."""
    if state_path.is_file():  # single device, DDP
        return torch.load(state_path, map_location="cpu", weights_only=True)["model"]
    if not ((state_path / "latest").exists() or any(state_path.glob("*/mp_rank_*"))):
        return _load_distributed_checkpoint(state_path)["model"]  # FSDP's and FSDP2's shards
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # ZeRO's fp32 master weights, plus the frozen ones (LoRA's base) ZeRO-1 leaves out, whole in its module file
    weights = get_fp32_state_dict_from_zero_checkpoint(str(state_path), tag="checkpoint")
    module_file = min((state_path / "checkpoint").glob("*model_states.pt"))  # ZeRO-3 writes one per rank
    # memory-mapped: only the tensors taken below are read
    module = torch.load(module_file, map_location="cpu", weights_only=True, mmap=True)["module"]
    weights.update({name: module[name] for name in module.keys() - weights.keys()})
    return weights


def save_weights(weights: dict, model: torch.nn.Module, folder: Path, fingerprint: dict) -> None:
    """The export of a task that writes none: ``model.pt``, the weights (``torch.load(..., weights_only=True)`` reads
    them back), and ``config.json``, the task's fingerprint (what defines the model and its outputs)."""
    torch.save(weights, folder / "model.pt")
    (folder / "config.json").write_text(json.dumps(fingerprint, indent=2))


def export_model(fabric, best_state: Path, out: Path, model: torch.nn.Module, fingerprint: dict,
                 write: Callable[[dict, torch.nn.Module, Path], None] | None = None) -> None:
    """On rank 0, the task's ``write(weights, model, folder)`` (else ``save_weights``) into a temporary folder that
    then replaces ``out``: never half written."""
    if fabric.is_global_zero:
        tmp = out.with_name(f".tmp-{out.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        weights = full_state_dict(best_state)
        if write is None:
            save_weights(weights, model, tmp, fingerprint)
        else:
            write(weights, model, tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    fabric.barrier()
