"""The contract between the loop (``train.py``) and a task (``task.py``). A task module provides:

- ``add_args(parser)``: its data and model flags; it may ``parser.set_defaults(...)`` loop flags to its own values.
- ``TEST_FLAGS``: its flags for a small offline run that learns in about a minute on two CPU cores (``tests/infra``).
- ``setup(args, verbose) -> TaskSpec``: on every rank, local rank 0 of each node first (it may cache for the others);
  ``verbose``: progress bars wanted. What it settles itself goes in ``TaskSpec.decided_flags``, not into ``args``.
- ``PRESETS`` (optional): ``{task flag: {loop flag: default}}``, defaults a task flag brings when set.
- ``predict(folder, file, flags, batch_size)`` (optional, for ``predict.py``): for each row of ``file``, read as the
  run (``flags``: its config.yaml) read its data, the exported model's ``Objective.predict`` columns and a ``"row"``.

The model's repeated blocks (what fsdp and fsdp2 shard, and ``--grad-checkpointing`` recomputes, one by one) are the
classes it names in ``_no_split_modules``, else the children of its ``nn.ModuleList``s. ``build_skeleton`` is built
already sharded: it must neither read nor initialize its parameters, which rank 0's ``build_model`` fills by name.
"""

from __future__ import annotations  # the types below are only named: task.py imports this before torch loads

from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
        """Each row's columns of ``test_predictions.csv`` (label, prediction, score), as tensors with the rows first
        (a vector per row becomes one cell), so that the loop can gather them over ranks. An objective may also
        have ``table(columns) -> columns``: every test row's, as test_predictions.csv shows them (names beside ids)."""


@dataclass(frozen=True)
class RowLengths:
    """Rows of different lengths (tokens): what batching groups, throughput counts and FLOPs are counted up to."""
    per_split: dict[str, Sequence[int]]  # each row's length, per split: training groups similar ones, evaluation sorts
    in_batch: Callable[[dict], torch.Tensor]  # a batch's real tokens per row, on the host (before it moves: no sync)
    longest: int  # no row is longer
    padded_to: Callable[[dict], int]  # the size every row of a batch is padded to: what the device computes


@dataclass
class TaskSpec:
    # required
    datasets: dict[str, Dataset]  # "train", "validation", "test": map-style, ds[i] is a row that collate takes
    # rows -> a batch: a dict of tensors, each rows first (evaluation slices padding rows off), targets under "labels"
    collate: Callable[[list], dict]
    # the model to train, weights in any dtype (the loop makes them fp32, then as precision wants); called at most once
    build_model: Callable[[], torch.nn.Module]
    objective: Objective
    # (rows, row length or None: the longest, device) -> a batch as the model gets it: FLOPs, batch-size probes
    example_batch: Callable[[int, int | None, torch.device | str], dict]
    # what defines the model and its outputs (source, labels), JSON-able: checkpoints record it, a resume must match it
    fingerprint: dict

    # optional: each comment ends with the loop's fallback
    # (best model's full weights, trained model, folder) -> its files; None: model.pt and config.json (fingerprint)
    export: Callable[[dict, torch.nn.Module, Path], None] | None = None
    lengths: RowLengths | None = None  # None: every row has one length (plain shuffles, no tokens/s)
    # build_model's architecture alone, fp32, same names, no value read or drawn; None: each rank builds build_model()
    build_skeleton: Callable[[], torch.nn.Module] | None = None
    # "train", "validation" -> the loss there of the best output that ignores the inputs (fitted on the training rows):
    # a run that ends at it on both is warned; None: no check
    chance_loss: dict[str, float] | None = None
    # optimizer steps -> the peak learning rate when --lr is not given; None: --lr has a default in the task's flags
    default_lr: Callable[[int], float] | None = None
    # flag -> the value the task settled (what auto detected): config.yaml records it, so a rerun repeats it; None: none
    decided_flags: dict | None = None
