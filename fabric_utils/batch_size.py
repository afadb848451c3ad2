"""``--batch-size auto``: the largest per-device batch whose training step fits, agreed by all ranks."""

import math
import time
from collections.abc import Callable

import torch

from fabric_utils.errors import UserError
from fabric_utils.progress import say

MAX_BATCH = 1024
MAX_STEP_SECONDS = 10.0  # on a CPU memory rarely runs out first: stop where a step gets impractically slow
MEMORY_HEADROOM = 0.9  # of the GPU's memory: the caching allocator's fragmentation needs the rest


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def find_batch_size(fabric, model, optimizer, *, make_batch: Callable[[int], dict],
                    loss_fn: Callable[[torch.nn.Module, dict], torch.Tensor], limit: int = MAX_BATCH) -> int:
    """Doubles the batch from 1 until a training step no longer fits; returns the largest that did, on every rank.
    ``make_batch(rows)`` gives a batch of that many rows at the longest length training will see, ``loss_fn(model,
    batch)`` the training loss.

    ``model`` and ``optimizer`` are the ones ``fabric.setup`` returned, so the probe pays for what training pays for:
    DDP's gradient buckets, FSDP's and DeepSpeed's shards and casts, the precision plugin, ``fabric.backward``, and
    the optimizer's state, allocated by a real ``optimizer.step()`` at learning rate 0 (which leaves the weights as
    they are). Afterwards the gradients and the optimizer's state are dropped and the learning rates put back, so
    training starts from the same point as without the probe.

    All ranks try the same sizes and agree after each try, because the collectives inside a wrapped step must stay
    in lockstep. A step that runs out of memory halfway can leave DDP, FSDP or DeepSpeed mid-reduction, so on a GPU
    the probe stops before a doubling whose predicted peak would pass MEMORY_HEADROOM of the device; on a CPU, where
    memory rarely runs out, it stops once a step takes MAX_STEP_SECONDS.
    """
    model.train()  # from_pretrained returns it in eval mode; what must fit is training's step, dropout included
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    best, size = 0, 1
    try:
        while size <= limit:
            fits, seconds, memory = _try_step(fabric, model, optimizer, make_batch(size), loss_fn)
            fits_twice = fits and (seconds <= MAX_STEP_SECONDS if fabric.device.type != "cuda"
                                   else _doubling_fits(memory, fabric.device))
            fits, fits_twice = fabric.all_reduce(torch.tensor([int(fits), int(fits_twice)], device=fabric.device),
                                                 reduce_op="min").tolist()
            if not fits:
                break
            best, size = size, size * 2
            if not fits_twice:
                break
    finally:
        optimizer.zero_grad(set_to_none=True)
        optimizer.state.clear()  # Adam's moments come back zeroed at the first real step, as without the probe
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
    if best == 0:
        raise UserError("not even one row fits in memory; use shorter rows, --grad-checkpointing or a sharded "
                        "--strategy")
    say(f"--batch-size auto: {best} rows per device")
    return best


def _try_step(fabric, model, optimizer, batch: dict, loss_fn) -> tuple[bool, float, dict]:
    """One training step on ``batch``: whether it fit, its seconds, and on a GPU the step's peak memory and what
    stays held after it (weights and optimizer state)."""
    if fabric.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(fabric.device)
    start = time.perf_counter()
    try:
        fabric.backward(loss_fn(model, batch))
        optimizer.step()
    except RuntimeError as err:
        if not _is_oom(err):
            raise
        return False, math.inf, {}
    finally:
        optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    if fabric.device.type != "cuda":
        return True, seconds, {}
    del batch
    return True, seconds, {"peak": torch.cuda.max_memory_allocated(fabric.device),
                           "held": torch.cuda.memory_allocated(fabric.device)}


def _doubling_fits(memory: dict, device: torch.device) -> bool:
    """Whether twice the rows fit: what a step adds over the memory held between steps (activations, which scale
    with the rows, and gradients, which do not: an overestimate on the safe side) doubles."""
    predicted = memory["held"] + 2 * (memory["peak"] - memory["held"])
    return predicted <= MEMORY_HEADROOM * torch.cuda.get_device_properties(device).total_memory
