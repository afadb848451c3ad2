"""How many CPU threads each process computes with: the idle CPUs it may use, shared among the node's processes, as
threads beyond the free cores wait on each other (torch and ``fabric run`` give each process every core)."""

import math
import os
import socket
import zlib
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

# what the user set, read before Lightning's launcher sets it in the process that starts the others
USER_OMP_THREADS = os.environ.get("OMP_NUM_THREADS")


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The CPUs this process may run on, fewer where its cgroup's quota (``cpu.max``) allows less."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return cpus
    return cpus if quota == "max" else max(1, min(cpus, math.ceil(int(quota) / int(period))))


def idle_cpus(seconds: float = 0.2) -> float:
    busy = psutil.cpu_percent(interval=seconds, percpu=True)
    return sum(1 - busy[cpu] / 100 for cpu in os.sched_getaffinity(0) if cpu < len(busy))


def choose_threads(requested: int | None, cpus: int, idle: Callable[[], float], sharing: int, user_setting: str | None,
                   launcher_sets_it: bool) -> tuple[int, str]:
    """The thread count and why: ``--num-threads``, else the user's ``OMP_NUM_THREADS``, else the idle ``cpus``
    divided among the ``sharing`` processes."""
    if requested:
        return requested, "--num-threads"
    if user_setting and user_setting.isdigit() and int(user_setting) > 0 and not launcher_sets_it:
        return int(user_setting), "OMP_NUM_THREADS"
    free = min(cpus, round(idle()))
    return max(1, free // sharing), f"{free} idle of {cpus} CPUs / {sharing} process{'es' * (sharing > 1)}"


def launcher_sets_threads() -> bool:
    """``fabric run`` sets OMP_NUM_THREADS to every CPU, torchrun to 1 with several processes: neither is the user's."""
    return os.environ.get("LT_CLI_USED") == "1" or "TORCHELASTIC_RUN_ID" in os.environ


def set_threads(fabric, requested: int | None) -> tuple[str, int]:
    """Sets torch's intra-op threads; returns the choice, for the header, and the processes sharing these CPUs (their
    loader workers divide them too)."""
    sharing = processes_sharing(fabric, os.sched_getaffinity(0))
    threads, why = choose_threads(requested, usable_cpus(), idle_cpus, sharing,
                                  USER_OMP_THREADS, launcher_sets_threads())
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # for the processes this one starts
    return f"{threads} thread{'s' * (threads > 1)} ({why})", sharing


def processes_sharing(fabric, cpus: set[int]) -> int:
    """How many of the job's processes run on this host with CPUs in common with ``cpus``."""
    mask = torch.zeros(1 + (os.cpu_count() or 1), dtype=torch.int64)  # [host id, one flag per CPU]
    mask[0] = zlib.crc32(socket.gethostname().encode())
    mask[1 + torch.tensor(sorted(cpus))] = 1
    masks = fabric.all_gather(mask).cpu().reshape(fabric.world_size, -1)
    same_host = masks[:, 0] == mask[0]
    overlaps = (masks[:, 1:] * mask[1:]).sum(dim=1) > 0
    return int((same_host & overlaps).sum())
