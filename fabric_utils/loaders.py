"""Batches of map-style datasets on any number of processes, grouped or sorted by row size so padding stays small."""

import dataclasses
import math
import signal
from collections.abc import Callable, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from fabric_utils.progress import say
from fabric_utils.errors import UserError


class TrainBatchSampler(Sampler[list[int]]):
    """This rank's batches of one epoch, set by (seed, epoch) and the rows per optimizer step alone, so a resume on any
    number of devices continues the same steps."""

    def __init__(self, lengths, batch_size, num_replicas=1, rank=0, seed=0, group_by_length=True, grad_accum=1):
        self.lengths = list(lengths)
        self.batch_size, self.num_replicas, self.rank = batch_size, num_replicas, rank
        self.seed, self.group_by_length, self.grad_accum = seed, group_by_length, grad_accum
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, 0
        if not 0 <= start_batch < len(self):  # an epoch with no batch left would never end
            raise UserError(f"cannot resume at batch {start_batch} of an epoch of {len(self)} batches: the checkpoint "
                            f"is not of this data; pass another --resume or start a new --out-dir")
        self.start_batch = start_batch

    def global_batches(self) -> list[list[int]]:
        """All ranks' batches, ``batch_size * num_replicas`` rows each (the last may have fewer)."""
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        order += order[: -len(order) % self.num_replicas]  # pad, as DistributedSampler does, to share evenly
        if self.group_by_length:  # similar lengths within an optimizer step, but a random sequence of lengths
            step = self.batch_size * self.num_replicas * self.grad_accum
            mega = step * 50  # sorted by length together
            order = [i for s in range(0, len(order), mega)
                     for i in sorted(order[s:s + mega], key=self.lengths.__getitem__, reverse=True)]
            steps = [order[s:s + step] for s in range(0, len(order), step)]
            whole = len(order) // step  # a short last step stays last, where the loop expects it
            order = [i for k in [*torch.randperm(whole, generator=g).tolist(), *range(whole, len(steps))]
                     for i in steps[k]]
        size = self.batch_size * self.num_replicas
        return [order[s:s + size] for s in range(0, len(order), size)]

    def __iter__(self):
        for batch in self.global_batches()[self.start_batch:]:
            yield batch[self.rank::self.num_replicas]

    def __len__(self) -> int:
        # each rank's rows, padded as global_batches pads them, in batches
        return math.ceil(math.ceil(len(self.lengths) / self.num_replicas) / self.batch_size) - self.start_batch


class EvalBatchSampler(Sampler[list[int]]):
    """Rank r scores rows r, r + W, ... sorted by length; the last batch is filled with repeats, so every rank runs as
    many batches of one size, as sharded strategies need (``num_real``: the real rows)."""

    def __init__(self, lengths, batch_size, num_replicas=1, rank=0):
        mine = sorted(range(rank, len(lengths), num_replicas), key=lambda i: lengths[i], reverse=True)
        self.num_real = len(mine)
        per_rank = math.ceil(math.ceil(len(lengths) / num_replicas) / batch_size) * batch_size
        self.indices = mine + (mine[-1:] or [0]) * (per_rank - len(mine))
        self.batch_size = batch_size

    def __iter__(self):
        for s in range(0, len(self.indices), self.batch_size):
            yield self.indices[s:s + self.batch_size]

    def __len__(self) -> int:
        return math.ceil(len(self.indices) / self.batch_size)

    def gather(self, fabric, columns: list[dict]) -> dict:
        """Each rank's per-row columns (a dict per batch) gathered: each real row once, in the split's order."""
        mine = {name: torch.cat([batch[name] for batch in columns]) for name in columns[0]}
        mine["row"] = torch.tensor(self.indices, device=fabric.device)
        mine["real"] = (torch.arange(len(self.indices), device=fabric.device) < self.num_real).int()
        every = {name: value.flatten(0, 1) if fabric.world_size > 1 else value
                 for name, value in fabric.all_gather(mine).items()}
        real = every.pop("real").bool()
        order = every["row"][real].argsort()
        return {"row": every.pop("row")[real][order], **{name: value[real][order] for name, value in every.items()}}


def fill_rows(batch: dict, rows: int) -> dict:
    """``batch`` with ``rows`` rows, its last repeated, so compiled graphs see one shape (``first_rows`` drops them)."""
    short = rows - len(batch["labels"])
    if short <= 0:
        return batch
    return {name: torch.cat([value, value[-1:].expand(short, *value.shape[1:])]) for name, value in batch.items()}


def first_rows(batch: dict, rows: int) -> dict:
    return {name: value[:rows] for name, value in batch.items()}


def ignore_sigterm_in_worker(worker_id: int) -> None:
    """SLURM signals loader workers too: one that died of it would fail the rank before its checkpoint."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def make_dataloaders(datasets: dict[str, Dataset], collate: Callable[[list], dict],
                     sizes: dict[str, Sequence[int]] | None, *, batch_size, eval_batch_size, world_size, rank, seed,
                     group_by_length, num_workers, pin_memory, grad_accum=1) -> dict:
    """``{"train", "validation", "test"}`` loaders, sharded by their samplers; without ``sizes``, rows are one size."""
    group_by_length = group_by_length and sizes is not None
    sizes = sizes or {name: [1] * len(dataset) for name, dataset in datasets.items()}
    samplers = {"train": TrainBatchSampler(sizes["train"], batch_size, world_size, rank, seed, group_by_length,
                                        grad_accum),
                **{name: EvalBatchSampler(sizes[name], eval_batch_size, world_size, rank)
                   for name in ("validation", "test")}}
    return {name: DataLoader(datasets[name], batch_sampler=sampler, collate_fn=collate, num_workers=num_workers,
                             pin_memory=pin_memory, persistent_workers=num_workers > 0,
                             worker_init_fn=ignore_sigterm_in_worker,
                             # not the global RNG, whose draws would shift dropout masks after a resume
                             generator=torch.Generator().manual_seed(seed))
            for name, sampler in samplers.items()}


def cut_splits(spec, batches: int, train_rows: int, eval_rows: int):
    """``spec`` with each split cut to its first ``batches`` batches (--fast-dev-run)."""
    rows = {"train": batches * train_rows, "validation": batches * eval_rows, "test": batches * eval_rows}
    datasets = {name: Subset(split, range(min(len(split), rows[name]))) for name, split in spec.datasets.items()}
    lengths = spec.lengths and dataclasses.replace(spec.lengths, per_split={
        name: [lengths[i] for i in range(len(datasets[name]))] for name, lengths in spec.lengths.per_split.items()})
    return dataclasses.replace(spec, datasets=datasets, lengths=lengths, chance_loss=None)  # at chance by design


def at_most_rows_per_device(batch_size: int, rows: int, world_size: int) -> int:
    """``batch_size``, or the training rows per device where there are fewer."""
    per_device = math.ceil(rows / world_size)
    if batch_size > per_device:
        say(f"--batch-size {batch_size} is more than the {per_device:,} training rows per device: using {per_device}")
    return min(batch_size, per_device)
