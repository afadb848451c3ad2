"""The contract between the loop (``train.py``) and a task (``task.py``): everything the loop needs to know about a
task, and nothing it needs to know about how the task does it.

A task module provides:

- ``add_args(parser)``: its own flags (data, model). It may also ``parser.set_defaults(...)`` loop flags it has its
  own values for (``lr``, ``epochs``, ``batch_size``, ...): they show in ``--help`` and a ``--config`` file or the
  command line still wins.
- ``PRESETS`` (optional): ``{flag: {loop flag: default}}``, defaults a task flag brings when it is set (a larger
  learning rate for adapters, say). ``--config`` and the command line win over them.
- ``TEST_FLAGS``: the task's flags for a small offline run that learns in about a minute on two CPU cores: the
  infrastructure tests (``tests/infra``) train whatever ``task.py`` is with them.
- ``setup(args, verbose) -> TaskSpec``: built from the parsed flags, whole. It runs on every rank, local rank 0 of
  each node first, so it may cache what it prepares (tokenization, downloads) for the others to read. ``verbose``
  (progress bars wanted) is false on every rank but the first, under ``--quiet``, and in a log unless ``--verbose``.
  It leaves ``args`` as parsed: what it decides for flags left to it (``--lr``, whose default is None: a rate for
  the model it loads) it returns in ``TaskSpec.chosen``, which the loop runs with and ``config.yaml`` records.

- ``predict(folder, file, flags, batch_size)`` (optional, for ``predict.py``): the exported model's (``folder``)
  ``Objective.predict`` columns, and a ``"row"`` index, for each row of a file, read as the run read its data
  (``flags``: the run's config.yaml).

A model bigger than one device: under ``fsdp``, ``fsdp2`` and ``deepspeed_stage_3`` a task that gives
``TaskSpec.build_skeleton`` has no rank hold its whole model (fabric_utils/pretrained.py). Every rank builds the
skeleton already sharded: its parameters on the meta device, or partitioned by ``deepspeed.zero.Init`` as they are
made, so it must neither read nor initialize their values; its buffers are kept as it makes them. Rank 0 alone calls
``build_model``, whose parameters and buffers, by name, fill each rank's shards. A resume calls no ``build_model``
under any strategy: the skeleton takes the checkpoint's values. Under ddp, one device and ZeRO-1/2, for a skeleton
that ties weights under fsdp and fsdp2, and for a task that gives no skeleton (the loop's fallback), every rank calls
``build_model`` and holds the whole model until the strategy shards it.

A model built by ``TaskSpec.build_model`` must take a batch through ``objective.forward`` and give outputs that
``objective.loss`` and the metrics take; batches are dicts of tensors, rows first, with the targets under
``"labels"`` (the loop scores exactly the real rows of each evaluation batch by slicing every tensor along its first
dimension).
"""

from __future__ import annotations  # the types below are only named: task.py imports this before torch loads

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset
    from torchmetrics import MetricCollection


class Objective(Protocol):
    """What training minimizes and evaluation reports."""
    best_metric: str  # the metric that picks checkpoints/best, a key of make_metrics()

    def forward(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        """The model's outputs for a batch (logits)."""

    def loss(self, outputs: torch.Tensor, batch: dict, reduction: str = "mean") -> torch.Tensor:
        """The mean loss, or one per row with ``reduction="none"`` (evaluation averages rows exactly)."""

    def make_metrics(self) -> MetricCollection:
        """Metrics updated with ``(outputs, batch["labels"])`` on the device; read only when computed."""

    def is_better(self, value: float, best: float | None) -> bool:
        """Whether ``value`` of ``best_metric`` beats ``best`` (None: nothing yet)."""

    def predict(self, outputs: torch.Tensor, batch: dict) -> dict[str, torch.Tensor]:
        """Each row's columns of ``test_predictions.csv`` (its label, the predicted label or value, a score), as
        tensors with the rows first (a vector per row becomes one cell): the loop gathers them over ranks."""


@dataclass
class TaskSpec:
    datasets: dict[str, Dataset]  # "train", "validation", "test": map-style, ds[i] is a row that collate takes
    collate: Callable[[list], dict]  # rows -> a batch: a dict of tensors, rows first, targets under "labels"
    # the model to train, its weights in any dtype (the loop makes them fp32, after sharding under fsdp2, then
    # converts them as the precision wants); the loop calls it once, where it chooses
    build_model: Callable[[], torch.nn.Module]
    objective: Objective
    # rows -> an input batch of that many rows at a row size (None: the task's only size), on a device: the loop
    # counts FLOPs on the meta device with it, and --batch-size auto tries steps on it
    example_batch: Callable[[int, int | None, torch.device | str], dict]
    # writes the hand-over artifact: (the best model's full weights, the trained model for its structure, folder)
    export: Callable[[dict, torch.nn.Module, Path], None]
    meta: dict  # what defines the model and its outputs (source, labels): checkpoints record it, resume compares it
    # each row's size per split (tokens for text): training groups similar sizes, evaluation sorts by size
    sizes: dict[str, Sequence[int]] | None = None
    row_sizes: Callable[[dict], torch.Tensor] | None = None  # a batch's size per row (real tokens): tokens/s, MFU
    max_size: int | None = None  # the largest row size (max tokens): FLOPs are fitted up to it, batches probed at it
    blocks: tuple[type, ...] = ()  # the model's repeated blocks: sharded one by one, recomputed in backward
    # build_model's architecture alone (head and adapters too, the same names), fp32, reading no weight and drawing
    # no initial value: see "A model bigger than one device" above. None: every rank builds build_model() whole
    build_skeleton: Callable[[], torch.nn.Module] | None = None
    notes: list[str] = field(default_factory=list)  # what preparing the data did that a user should know
    # the training loss of the best output that ignores the inputs (chance level): a run whose loss stays there is said
    # not to learn
    chance_loss: float | None = None
    # flag name (as in args) -> the value the task chose for it ("lr" where --lr was left to it, what auto detected)
    chosen: dict = field(default_factory=dict)
