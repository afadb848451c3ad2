"""Speed: worker counts, torch.compile and its warm-up, peak memory."""

import contextlib
import itertools
import os
import resource
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from lightning.fabric.utilities.data import suggested_max_num_workers

from fabric_utils.private import shape_config
from fabric_utils.threads import processes_sharing


def default_num_workers(fabric) -> int:
    """Workers only collate: none on a CPU device, whose cores the model uses; else Lightning's suggestion, up to 4."""
    if fabric.device.type == "cpu":
        return 0
    return min(4, suggested_max_num_workers(processes_sharing(fabric, os.sched_getaffinity(0))))


def compile_model(model: torch.nn.Module, mode: str = "default", cuda_graphs: bool = False,
                  **kwargs) -> torch.nn.Module:
    """torch.compile, dynamic so one graph takes every length, sizes never tied (16 rows of 16 tokens would recompile
    the next batch); ``default`` is reduce-overhead (CUDA graphs) where ``cuda_graphs``."""
    if mode == "default" and cuda_graphs:
        mode = "reduce-overhead"
    shape_config.use_duck_shape = False
    return torch.compile(model, mode=mode, dynamic=True, **kwargs)


def batch_kinds(batches: Iterable[dict], look_at: int = 50) -> list[dict]:
    """One batch of each set of inputs (each takes its own compiled graph) among the first ``look_at``."""
    return list({frozenset(batch): batch for batch in itertools.islice(batches, look_at)}.values())


def warm_up(fabric, model, optimizer, batches: list[dict],
            loss_fn: Callable[[torch.nn.Module, dict], torch.Tensor]) -> None:
    """Compiles the training and evaluation graphs of each kind of batch before the clock starts; the optimizer drops
    the gradients (ZeRO-3's shards only it clears)."""
    for batch in batches:
        fabric.backward(loss_fn(model, batch))
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        for batch in batches:
            loss_fn(model, batch)
    model.train()


def peak_memory_mb(device: torch.device) -> float:
    """Peak device memory; on CPU this process's VmHWM, as ``ru_maxrss`` starts at the parent's peak after exec."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # macOS: bytes


def peak_memory_per_rank(fabric) -> list[float]:
    """Every rank's ``peak_memory_mb``: sharding is judged by what each rank holds."""
    peak = torch.tensor([peak_memory_mb(fabric.device)], dtype=torch.float64, device=fabric.device)
    return fabric.all_gather(peak).flatten().tolist()
