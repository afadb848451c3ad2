"""The FLOPs of a training step, for MFU: counted by Fabric's ``measure_flops`` on fake tensors; loaded only where MFU
can be known (a GPU, or ``--peak-tflops``)."""

import copy
from collections.abc import Callable

import numpy as np
import torch
from lightning.fabric.utilities.throughput import measure_flops
from lightning_utilities.core.apply_func import apply_to_collection

from fabric_utils.errors import first_line
from fabric_utils.private import FakeTensorMode
from fabric_utils.progress import say
from fabric_utils.sharding import full_shape


def training_flops_fn(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, dict], torch.Tensor],
                      example_batch: Callable[[int | None], dict],
                      max_size: int | None) -> Callable[[int, int, int], float] | None:
    """``flops(rows, sizes, sizes_sq)``: a training step's FLOPs, a quadratic in the row size (linear layers +
    attention) fitted to counts at three sizes on fake tensors; where a forward reads its inputs' values, which fake
    tensors lack, 6 x matrix weights x tokens, or None without sizes."""
    points = [None] if max_size is None else sorted({max(max_size // 4, 1), max(max_size // 2, 2), max_size})
    try:
        measured = count_flops(model, loss_fn, [example_batch(size) for size in points])
    except Exception as err:  # it only feeds MFU, which must not stop the run
        reason = f"counting FLOPs on fake tensors failed ({type(err).__name__}: {first_line(err)})"
        if max_size is None:
            say(f"MFU unknown: {reason}")
            return None
        per_token = 6 * sum(full_shape(param).numel() for name, param in matrix_weights(model))
        say(f"MFU counts 6 x matrix weights x tokens, attention left out: {reason}")
        return lambda rows, sizes, sizes_sq: per_token * sizes
    if max_size is None:
        return lambda rows, sizes, sizes_sq: measured[0] * rows
    coeffs = np.polyfit(points, measured, deg=min(2, len(points) - 1))[::-1].tolist()  # constant term first
    c0, c1, c2 = coeffs + [0.0] * (3 - len(coeffs))
    return lambda rows, sizes, sizes_sq: c0 * rows + c1 * sizes + c2 * sizes_sq


def count_flops(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, dict], torch.Tensor],
                batches: list) -> list[int]:
    """Fabric's ``measure_flops`` of a forward and backward of each batch, on a fake copy of ``model``."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    on_fake = fake_copy(model, mode)
    measured = []
    for batch in batches:
        fake_batch = apply_to_collection(batch, torch.Tensor, lambda tensor: mode.from_tensor(tensor.to("meta")))
        with mode:
            measured.append(measure_flops(on_fake, lambda: loss_fn(on_fake, fake_batch), lambda loss: loss))
    return measured


def fake_copy(module: torch.nn.Module, mode: FakeTensorMode) -> torch.nn.Module:
    """``module`` of fake tensors, no weight copied."""
    memo = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        fake = mode.from_tensor(torch.empty(full_shape(tensor), dtype=tensor.dtype, device="meta"))
        memo[id(tensor)] = torch.nn.Parameter(fake, tensor.requires_grad) if isinstance(
            tensor, torch.nn.Parameter) else fake
    return copy.deepcopy(module, memo)


def matrix_weights(model: torch.nn.Module):
    """(name, weight) of every matrix that multiplies activations, embedding tables left out."""
    tables = {id(module.weight) for module in model.modules() if isinstance(module, torch.nn.Embedding)}
    return [(name, param) for name, param in model.named_parameters()
            if len(full_shape(param)) >= 2 and id(param) not in tables]
