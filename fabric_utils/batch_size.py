"""``--batch-size auto``: the largest per-device batch whose training step fits, agreed by all ranks."""

import time

import torch

from fabric_utils.errors import UserError

MAX_BATCH = 1024
MAX_STEP_SECONDS = 10.0  # on a CPU memory rarely runs out first: stop where a step gets impractically slow


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def find_batch_size(fabric, args, model, tokenizer, limit: int = MAX_BATCH) -> int:
    """Doubles the batch from 1, running forward and backward on full-length rows, until memory runs out (or a
    step passes MAX_STEP_SECONDS on a CPU); returns the largest that worked, the minimum over ranks."""
    model.to(fabric.device).train()
    vocab = max(len(tokenizer), 2)
    best, size = 0, 1
    while size <= limit:
        batch = {"input_ids": torch.randint(1, vocab, (size, args.max_length), device=fabric.device),
                 "labels": torch.zeros(size, dtype=torch.long, device=fabric.device)}
        try:
            start = time.perf_counter()
            with fabric.autocast():
                loss = model(**batch).loss
            loss.backward()
            seconds = time.perf_counter() - start
        except RuntimeError as err:
            if not _is_oom(err):
                raise
            break
        finally:
            model.zero_grad(set_to_none=True)
            if fabric.device.type == "cuda":
                torch.cuda.empty_cache()
        best, size = size, size * 2
        if fabric.device.type != "cuda" and seconds > MAX_STEP_SECONDS:
            break
    agreed = int(fabric.all_reduce(torch.tensor(best, device=fabric.device), reduce_op="min"))
    if agreed == 0:
        raise UserError(f"not even one row of --max-length {args.max_length} fits in memory; lower --max-length, "
                        f"use --grad-checkpointing or a sharded --strategy")
    fabric.print(f"--batch-size auto: {agreed} rows per device")
    return agreed
