"""Speed: worker counts and peak memory."""

import contextlib
import resource
from pathlib import Path

import torch
from lightning.fabric.utilities.data import suggested_max_num_workers



def default_num_workers(device: torch.device, sharing: int) -> int:
    """Workers only collate: none on a CPU device, whose cores the model uses; else Lightning's suggestion for the
    ``sharing`` processes on these CPUs (``set_threads``), up to 4."""
    if device.type == "cpu":
        return 0
    return min(4, suggested_max_num_workers(sharing))


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
