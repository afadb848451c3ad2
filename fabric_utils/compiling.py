"""``--compile``: torch.compile, and its warm-up before the clock starts; loaded only when that flag asks."""

import itertools
from collections.abc import Callable, Iterable

import torch

from fabric_utils.private import shape_config


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
