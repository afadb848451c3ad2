"""Speed helpers the loop calls: backend switches, worker counts, FLOP counting for MFU, compile warm-up."""

import os
import resource

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
    model's own threads, so none there; on GPUs up to 4 per process, within this node's CPUs."""
    if fabric.device.type == "cpu":
        return 0
    per_node = max(fabric.world_size // getattr(fabric.strategy, "num_nodes", 1), 1)
    return max(0, min(4, (os.cpu_count() or 1) // per_node - 1))


def training_flops_fn(config, max_length: int):
    """Returns ``flops(lengths)``: the FLOPs of forward and backward for rows of the given non-padding lengths.

    Fabric's ``measure_flops`` counts them on a meta-device copy of the model (no memory, no time) at three lengths;
    a quadratic in the length (linear layers + attention) fits them exactly and prices any row.
    """
    from transformers import AutoModelForSequenceClassification

    with torch.device("meta"):
        meta_model = AutoModelForSequenceClassification.from_config(config)
    points = sorted({max(max_length // 4, 1), max(max_length // 2, 2), max_length})
    measured = []
    for length in points:
        ids = torch.zeros(1, length, dtype=torch.long, device="meta")
        measured.append(measure_flops(meta_model, lambda: meta_model(input_ids=ids).logits, lambda y: y.sum()))
    coeffs = np.polyfit(points, measured, deg=min(2, len(points) - 1))
    c = torch.tensor(coeffs[::-1].copy(), dtype=torch.float64)

    def flops(lengths: torch.Tensor) -> torch.Tensor:
        n = lengths.to(torch.float64)
        return sum(c[i].to(n.device) * n**i for i in range(len(c))).sum()
    return flops


def make_throughput_monitor(fabric, peak_tflops: float | None) -> ThroughputMonitor:
    monitor = ThroughputMonitor(fabric, window_size=5)
    if peak_tflops:  # Fabric knows the peak of common GPUs, not of CPUs
        monitor.available_flops = peak_tflops * 1e12
    return monitor


def mfu(monitor: ThroughputMonitor, fabric, flops: float, seconds: float) -> float | None:
    """Model FLOPs utilisation over the whole training loop: useful (non-padding) FLOPs per second of all ranks
    over the peak of all devices."""
    total = float(fabric.all_reduce(torch.as_tensor(float(flops), dtype=torch.float64), reduce_op="sum"))
    if not monitor.available_flops:
        return None
    return total / seconds / (monitor.available_flops * fabric.world_size)


def warm_up(fabric, model, optimizer, loader) -> None:
    """Runs a training step's forward and backward, and an evaluation forward, so torch.compile builds both graphs
    before the clock starts. The gradients are dropped, so the weights and the first step are untouched: through
    the optimizer's ``zero_grad``, because DeepSpeed's ZeRO-3 has already moved them into its gradient shards,
    where only its own ``zero_grad`` makes the next backward overwrite them rather than add to them."""
    batch = next(iter(loader))
    fabric.backward(model(**batch).loss)
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        model(**batch)
    model.train()


def peak_memory_mb(device: torch.device) -> float:
    """Peak device memory on CUDA; peak resident memory of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
