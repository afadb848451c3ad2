"""The contract between the loop (``train.py``) and a task (``task.py``): what the loop needs to know about a task,
and nothing about how the task does it. A task module provides:

- ``add_args(parser)``: its data and model flags; it may ``parser.set_defaults(...)`` loop flags to its own values.
- ``TEST_FLAGS``: its flags for a small offline run that learns in about a minute on two CPU cores (``tests/infra``).
- ``setup(args, verbose) -> TaskSpec``: on every rank, local rank 0 of each node first (it may cache for the others);
  ``verbose``: progress bars wanted. It leaves ``args`` as parsed and returns what it decides in ``TaskSpec.chosen``.
- ``PRESETS`` (optional): ``{task flag: {loop flag: default}}``, defaults a task flag brings when set.
- ``predict(folder, file, flags, batch_size)`` (optional, for ``predict.py``): for each row of ``file``, read as the
  run (``flags``: its config.yaml) read its data, the exported model's ``Objective.predict`` columns and a ``"row"``.

``build_skeleton``, for a model bigger than one device, is built already sharded under fsdp, fsdp2 and ZeRO-3: it must
neither read nor initialize its parameters, as rank 0's ``build_model`` (or a resume's checkpoint) fills them by name.
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
        """Each row's columns of ``test_predictions.csv`` (label, prediction, score), as tensors with the rows first
        (a vector per row becomes one cell), so that the loop can gather them over ranks."""


@dataclass
class TaskSpec:
    # required
    datasets: dict[str, Dataset]  # "train", "validation", "test": map-style, ds[i] is a row that collate takes
    # rows -> a batch: a dict of tensors, each rows first (evaluation slices padding rows off), targets under "labels"
    collate: Callable[[list], dict]
    # the model to train, weights in any dtype (the loop makes them fp32, then as precision wants); called at most once
    build_model: Callable[[], torch.nn.Module]
    objective: Objective
    # (rows, row size or None: the largest, device) -> an input batch as the model gets it, to count FLOPs (made of
    # fake tensors) and probe batch sizes
    example_batch: Callable[[int, int | None, torch.device | str], dict]
    export: Callable[[dict, torch.nn.Module, Path], None]  # (best model's full weights, trained model, folder) -> files
    meta: dict  # what defines the model and its outputs (source, labels): checkpoints record it, resume compares it

    # optional: each comment ends with the loop's fallback where it has one
    # each row's size per split (tokens): training groups similar sizes, evaluation sorts; None: plain shuffles
    sizes: dict[str, Sequence[int]] | None = None
    # a batch's real tokens per row, from the batch on the host (before it moves: no device read); None: no tokens/s
    row_sizes: Callable[[dict], torch.Tensor] | None = None
    max_size: int | None = None  # the largest row size (tokens): FLOPs are fitted up to it; None: rows have one size
    blocks: tuple[type, ...] = ()  # repeated blocks, sharded and recomputed one by one; (): the model's ModuleLists
    # build_model's architecture alone, fp32, same names, no value read or drawn; None: each rank builds build_model()
    build_skeleton: Callable[[], torch.nn.Module] | None = None
    notes: list[str] = field(default_factory=list)  # what preparing the data did that a user should know
    # "train", "validation" -> the loss there of the best output that ignores the inputs (fitted on the training rows):
    # a run that ends at it on both is warned; None: no check
    chance_loss: dict[str, float] | None = None
    # optimizer steps -> the peak learning rate when --lr is not given (the run's length is known only after the
    # loaders); None: --lr has a default in the task's flags
    default_lr: Callable[[int], float] | None = None
    chosen: dict = field(default_factory=dict)  # flag -> value the task chose (what auto detected)
    # every test row's objective.predict columns -> test_predictions.csv's (label names beside ids); None: as they are
    prediction_table: Callable[[dict], dict] | None = None
