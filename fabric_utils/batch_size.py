"""``--batch-size auto``: the largest batch whose training step fits on every rank."""

import time
from collections.abc import Callable

import torch

from fabric_utils.errors import UserError
from fabric_utils.progress import say

MAX_BATCH = 1024
MAX_STEP_SECONDS = 10.0  # on a CPU memory rarely runs out first
MEMORY_HEADROOM = 0.9  # of the GPU's memory: the caching allocator's fragmentation needs the rest


def find_batch_size(fabric, model, optimizer, *, make_batch: Callable[[int], dict],
                    loss_fn: Callable[[torch.nn.Module, dict], torch.Tensor], limit: int = MAX_BATCH) -> int:
    """Doubles the batch from 1 while a real step at rate 0 fits; all ranks in lockstep, stopping before a step that
    would not fit, as one out of memory halfway can leave a strategy mid-reduction."""
    model.train()  # dropout included
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    best, size = 0, 1
    try:
        while size <= limit:
            fits = torch.tensor(_try_step(fabric, model, optimizer, make_batch(size), loss_fn), device=fabric.device)
            fits, fits_twice = fabric.all_reduce(fits, reduce_op="min").tolist()
            if fits:
                best, size = size, size * 2
            if not fits_twice:
                break
    finally:
        optimizer.zero_grad(set_to_none=True)
        optimizer.state.clear()  # as without the probe
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
    if best == 0:
        raise UserError("not even one row fits in memory; use shorter rows, --grad-checkpointing or a sharded "
                        "--strategy")
    say(f"--batch-size auto: {best} rows per device")
    return best


def _try_step(fabric, model, optimizer, batch: dict, loss_fn) -> tuple[int, int]:
    """One step: whether it fit, and whether twice the rows would (CPU: in time; GPU: twice the memory it added)."""
    cuda = fabric.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(fabric.device)
    start = time.perf_counter()
    try:
        fabric.backward(loss_fn(model, batch))
        optimizer.step()
    except RuntimeError as err:
        if not (isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()):
            raise
        return 0, 0
    finally:
        optimizer.zero_grad(set_to_none=True)
    if not cuda:
        return 1, int(time.perf_counter() - start <= MAX_STEP_SECONDS)
    del batch
    held = torch.cuda.memory_allocated(fabric.device)
    predicted = held + 2 * (torch.cuda.max_memory_allocated(fabric.device) - held)
    return 1, int(predicted <= MEMORY_HEADROOM * torch.cuda.get_device_properties(fabric.device).total_memory)
