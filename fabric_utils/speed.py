"""Speed helpers the loop calls: backend switches, worker counts, FLOP counting for MFU, compile warm-up."""

import contextlib
import copy
import itertools
import os
import resource
import socket
import time
import zlib
from collections.abc import Callable

import numpy as np
import torch
from lightning.fabric.utilities.throughput import ThroughputMonitor, measure_flops


def configure_backends(device: torch.device) -> None:
    """TF32 matrix products and cuDNN autotuning: free speed on Ampere+ GPUs, meaningless elsewhere."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.benchmark = True


def default_num_workers(fabric) -> int:
    """Tokenization is done ahead, so workers only collate. On a CPU device they would take cores from the
    model's own threads, so none there; on GPUs up to 4 per process, within the CPUs this process may run on (its
    affinity, which taskset, cgroups and SLURM's binding narrow; os.cpu_count() is the node's), split among the
    processes of this node that may run on them too, one CPU left to each process itself."""
    if fabric.device.type == "cpu":
        return 0
    cpus = os.sched_getaffinity(0)
    return min(4, max(1, len(cpus) // processes_sharing(fabric, cpus) - 1))


def processes_sharing(fabric, cpus: set[int]) -> int:
    """How many processes of the job (this one included) run on this machine with CPUs in common with ``cpus``.
    Lightning's launcher and torchrun leave every process the node's CPUs; SLURM binds each task to its own
    (--cpus-per-task), so dividing those among the node's processes again would leave one worker each."""
    mask = torch.zeros(1 + (os.cpu_count() or 1), dtype=torch.int64)  # [host id, one flag per CPU]
    mask[0] = zlib.crc32(socket.gethostname().encode())
    mask[1 + torch.tensor(sorted(cpus))] = 1
    masks = fabric.all_gather(mask).cpu().reshape(fabric.world_size, -1)
    same_host = masks[:, 0] == mask[0]
    overlaps = (masks[:, 1:] * mask[1:]).sum(dim=1) > 0
    return int((same_host & overlaps).sum())


def training_flops_fn(model: torch.nn.Module, step_loss: Callable[[torch.nn.Module, int | None], torch.Tensor],
                      max_size: int | None) -> Callable[[int, int, int], float]:
    """Returns ``flops(rows, sizes, sizes_sq)``: the FLOPs of forward and backward over ``rows`` rows whose sizes
    (real tokens, for text) add up to ``sizes``, ``sizes_sq`` the sum of each row's size squared.

    ``step_loss(model, size)`` runs the training forward on one row of ``size`` (None where rows have no size, as
    images) and returns the loss. Fabric's ``measure_flops`` counts it on a meta-device copy of the model (no memory,
    no time); with sizes, at three of them, and a quadratic in the size (linear layers + attention) fits them
    exactly, so the loop only keeps three sums on the device and never copies anything per step.
    """
    meta_model = meta_copy(model)
    if max_size is None:
        per_row = measure_flops(meta_model, lambda: step_loss(meta_model, None), lambda loss: loss)
        return lambda rows, sizes, sizes_sq: per_row * rows
    points = sorted({max(max_size // 4, 1), max(max_size // 2, 2), max_size})
    measured = [measure_flops(meta_model, lambda: step_loss(meta_model, size), lambda loss: loss)
                for size in points]
    coeffs = np.polyfit(points, measured, deg=min(2, len(points) - 1))[::-1].tolist()  # constant term first
    c0, c1, c2 = coeffs + [0.0] * (3 - len(coeffs))

    def flops(rows: int, sizes: int, sizes_sq: int) -> float:
        return c0 * rows + c1 * sizes + c2 * sizes_sq
    return flops


def meta_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` on the meta device: the same structure and shapes, without copying any weight (ZeRO-3's
    partitions, empty tensors, keep their whole shape in ``ds_shape``)."""
    memo = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        on_meta = torch.empty(getattr(tensor, "ds_shape", tensor.shape), dtype=tensor.dtype, device="meta")
        memo[id(tensor)] = torch.nn.Parameter(on_meta, tensor.requires_grad) if isinstance(
            tensor, torch.nn.Parameter) else on_meta
    return copy.deepcopy(module, memo)


class Throughput:
    """Rows, their sizes (real tokens, where the task gives sizes) and FLOPs of this process, counted on the device
    every micro-batch and read back
    only at log steps; Fabric's ``ThroughputMonitor`` turns them into rates and MFU in the logs, and ``stop()`` into
    the whole loop's figures for results.json. The clock is training time: what runs under ``paused()``
    (validation, checkpoints) is left out, so rates, MFU and the logged ``time`` compare across validation settings.
    A resumed run counts from its resume."""

    def __init__(self, fabric, peak_tflops: float | None, flops_of: Callable[[int, int, int], float], sized: bool):
        self.fabric, self.flops_of, self.sized = fabric, flops_of, sized
        self.monitor = ThroughputMonitor(fabric, window_size=5)
        if peak_tflops:  # Fabric knows the peak of common GPUs, not of CPUs nor of every GPU (H200)
            self.monitor.available_flops = peak_tflops * 1e12
        self.counts = torch.zeros(3, dtype=torch.int64, device=fabric.device)  # rows, sizes, sum of sizes²
        self.flops_logged = 0.0

    def start(self, step: int) -> None:
        reset_peak_memory(self.fabric.device)  # not the batch-size finder's or the compile warm-up's peak
        self.start_time, self.start_step, self.paused_s = time.perf_counter(), step, 0.0

    @contextlib.contextmanager
    def paused(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - start

    def seconds(self) -> float:
        """Training seconds since ``start``."""
        return time.perf_counter() - self.start_time - self.paused_s

    def count(self, rows: int, sizes: torch.Tensor | None) -> None:
        """``rows`` (a Python int: the batch's shape, no sync), and each row's size where the task gives sizes."""
        if sizes is None:
            self.counts[0] += rows
        else:
            self.counts += torch.stack((torch.ones_like(sizes).sum(), sizes.sum(), (sizes * sizes).sum()))

    def log(self, step: int) -> dict:
        rows, tokens, tokens_sq = self.counts.tolist()  # sync: log steps only
        flops = self.flops_of(rows, tokens, tokens_sq)
        self.monitor.update(time=self.seconds(), batches=step - self.start_step, samples=rows,
                            lengths=tokens if self.sized else None,
                            flops=flops - self.flops_logged)  # it takes FLOPs since its last update
        self.flops_logged = flops
        return self.monitor.compute_and_log(step=step)

    def stop(self) -> dict:
        """The whole loop over all ranks: seconds, rows/s, sizes/s (tokens/s for text; only where the task gives
        sizes), and MFU (None where the peak is unknown)."""
        seconds = self.seconds()
        rows, tokens, tokens_sq = self.counts.tolist()
        flops = self.flops_of(rows, tokens, tokens_sq)
        totals = self.fabric.all_reduce(torch.tensor([rows, tokens, flops], dtype=torch.float64,
                                                     device=self.fabric.device), reduce_op="sum").tolist()
        peak = self.monitor.available_flops
        return {"train_time_s": seconds, "train_samples_per_s": totals[0] / seconds,
                **({"train_tokens_per_s": totals[1] / seconds} if self.sized else {}),
                "mfu": totals[2] / seconds / (peak * self.fabric.world_size) if peak else None}


def compile_model(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """An ``OptimizedModule``, as Fabric expects: ``fabric.setup`` unwraps it, wraps the model with the strategy
    (DDP, FSDP, DeepSpeed) and compiles the wrapper with the same arguments, so every graph is traced under the
    wrapper (for DDP, dynamo then splits it at gradient-bucket boundaries, letting the all-reduce overlap backward).
    ``dynamic``: lengths vary per batch, so one dynamic-shape graph instead of a recompile per padded length."""
    return torch.compile(model, mode=mode, dynamic=True)


def warm_up(fabric, model, optimizer, batch: dict, loss_fn: Callable[[torch.nn.Module, dict], torch.Tensor]) -> None:
    """Runs a training step's forward and backward, and an evaluation forward, so torch.compile builds both graphs
    before the clock starts. The gradients are dropped, so the weights and the first step are untouched: through
    the optimizer's ``zero_grad``, because DeepSpeed's ZeRO-3 has already moved them into its gradient shards,
    where only its own ``zero_grad`` makes the next backward overwrite them rather than add to them."""
    fabric.backward(loss_fn(model, batch))
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        loss_fn(model, batch)
    model.train()


def reset_peak_memory(device: torch.device) -> None:
    """CUDA only: a process's peak resident memory on a CPU cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """Peak device memory on CUDA; peak resident memory of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_memory_per_rank(fabric) -> list[float]:
    """Every rank's ``peak_memory_mb``, in rank order: sharding is judged by what each rank holds, not rank 0."""
    peak = torch.tensor([peak_memory_mb(fabric.device)], dtype=torch.float64, device=fabric.device)
    return fabric.all_gather(peak).flatten().tolist()
