"""Hand over the best model: its full weights, gathered from any strategy's checkpoint, written by the task."""

import shutil
from collections.abc import Callable
from pathlib import Path

import torch


def full_state_dict(state_path: Path) -> dict:
    """The model's full, unsharded weights from a ``fabric.save`` checkpoint of any strategy."""
    if state_path.is_file():  # single device, DDP
        return torch.load(state_path, map_location="cpu", weights_only=True)["model"]
    if (state_path / "latest").exists() or any(state_path.glob("*/mp_rank_*")):  # DeepSpeed ZeRO shards
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        return get_fp32_state_dict_from_zero_checkpoint(str(state_path), tag="checkpoint")
    from lightning.fabric.utilities.load import _load_distributed_checkpoint  # FSDP's and FSDP2's shards
    return _load_distributed_checkpoint(state_path)["model"]


def export_model(fabric, best_state: Path, out: Path, write: Callable[[dict, Path], None]) -> None:
    """On rank 0, ``write(full_state_dict, folder)`` into a temporary folder that then replaces ``out``, so ``out`` is
    never half written."""
    if fabric.is_global_zero:
        tmp = out.with_name(f".tmp-{out.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write(full_state_dict(best_state), tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    fabric.barrier()
