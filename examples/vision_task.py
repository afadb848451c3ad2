"""The task: image classification with a small vision transformer on scikit-learn's handwritten digits (no download).
A drop-in task.py (the contract: fabric_utils/task_spec.py) proving the loop needs nothing else: copied over task.py,
no other file changed, `python train.py --accelerator cpu --devices 2 --strategy fsdp2` trains it."""

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import Dataset, default_collate
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from fabric_utils.args import positive_int
from fabric_utils.errors import UserError
from fabric_utils.task_spec import TaskSpec

SPLIT_SEED = 0  # not --seed: every run, whatever its seed, is scored on the same held-out rows
IMAGE_SIZE = 8
TEST_FLAGS = ["--epochs", "5"]  # the small run of tests/infra: 100 steps, test accuracy about 0.95


def add_args(parser: argparse.ArgumentParser) -> None:
    # a transformer trained from scratch on 1,257 images: a large rate, many short epochs (the best of a sweep)
    parser.set_defaults(lr=2e-3, epochs=15, batch_size=32, warmup=0.1, weight_decay=0.05, scheduler="cosine")
    g = parser.add_argument_group("data: scikit-learn's handwritten digits (1,797 8x8 images, 10 classes)")
    g.add_argument("--test-size", type=positive_int, default=360,
                   help="held-out test rows (stratified, drawn with a fixed seed: the same rows whatever --seed)")
    g.add_argument("--val-size", type=positive_int, default=180, help="validation rows, from the rest")
    g.add_argument("--train-size", type=positive_int, help="use this many of the remaining rows (default: all)")
    g = parser.add_argument_group("model: a vision transformer")
    g.add_argument("--patch-size", type=int, choices=(1, 2, 4), default=4,
                   help="side of the square patches: 4 (four tokens per image) is the most accurate")
    g.add_argument("--dim", type=positive_int, default=64, help="width of the patch embeddings")
    g.add_argument("--depth", type=positive_int, default=4, help="transformer blocks")
    g.add_argument("--heads", type=positive_int, default=4, help="attention heads (must divide --dim)")


def setup(args: argparse.Namespace, verbose: bool) -> TaskSpec:
    """The task for these flags: the splits, the model builder and the objective."""
    if args.dim % args.heads:
        raise UserError(f"--heads {args.heads} must divide --dim {args.dim}")
    splits, classes = load_splits(args.train_size, args.val_size, args.test_size)
    # normalization from the training rows alone; the model applies it, so the export takes raw pixels
    train_pixels = splits["train"].images
    architecture = dict(patch_size=args.patch_size, dim=args.dim, depth=args.depth, heads=args.heads,
                        num_classes=len(classes), pixel_mean=train_pixels.mean().item(),
                        pixel_std=train_pixels.std().item())

    def example_batch(rows: int, size: int | None, device) -> dict:
        return {"pixels": torch.zeros(rows, IMAGE_SIZE, IMAGE_SIZE, device=device),
                "labels": torch.zeros(rows, dtype=torch.long, device=device)}

    # the loop's export writes the weights and this fingerprint, all load_exported needs
    return TaskSpec(
        datasets=splits, collate=default_collate, build_model=lambda: ViT(**architecture),
        objective=DigitsObjective(num_classes=len(classes)), example_batch=example_batch,
        fingerprint={"architecture": architecture, "classes": classes})


@dataclass
class Digits(Dataset):
    """Rows of ``{"pixels": (8, 8) float, "labels": int}``, which ``default_collate`` stacks into a batch."""
    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"pixels": self.images[i], "labels": self.labels[i]}


def load_splits(train_size: int | None, val_size: int, test_size: int) -> tuple[dict[str, Digits], list[str]]:
    """Stratified test, then validation rows, then (up to ``train_size``) training rows, always drawn the same way."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32)  # (1797, 8, 8), ink from 0 to 16
    labels = torch.tensor(digits.target)
    if val_size + test_size >= len(labels):
        raise UserError(f"--val-size {val_size} and --test-size {test_size} leave no training rows of {len(labels)}")
    try:
        rest, test = train_test_split(torch.arange(len(labels)), test_size=test_size, stratify=labels,
                                      random_state=SPLIT_SEED)
        train, val = train_test_split(rest, test_size=val_size, stratify=labels[rest], random_state=SPLIT_SEED)
    except ValueError as err:  # a split too small to hold every class once
        raise UserError(f"--val-size {val_size}, --test-size {test_size}: {err}") from err
    train = train[:train_size]  # already shuffled
    classes = [str(name) for name in digits.target_names]
    return {name: Digits(images[rows], labels[rows])
            for name, rows in (("train", train), ("validation", val), ("test", test))}, classes


class Block(nn.Module):
    """``x + attention(norm(x))``, then ``x + mlp(norm(x))``: the unit sharded and recomputed (found in the ModuleList)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, tokens, dim = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(rows, tokens, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(rows, tokens, dim)
        x = x + self.proj(attended)
        return x + self.mlp(self.mlp_norm(x))


class ViT(nn.Module):
    """Patches -> linear embeddings + learned positions -> blocks -> the mean of the patch tokens -> class logits.
    Mean pooling, not a class token (as in arXiv:2205.01580): no token must first learn to gather the others."""

    def __init__(self, patch_size: int, dim: int, depth: int, heads: int, num_classes: int, pixel_mean: float,
                 pixel_std: float):
        super().__init__()
        self.pixel_mean, self.pixel_std = pixel_mean, pixel_std
        # a convolution whose stride is its kernel: one linear map applied to each non-overlapping patch
        self.patch_embed = nn.Conv2d(1, dim, kernel_size=patch_size, stride=patch_size)
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, (IMAGE_SIZE // patch_size) ** 2, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, num_classes)
        # a zero head starts every class at the same logit, as that paper does
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels``: (rows, 8, 8) raw ink values -> (rows, classes) logits."""
        x = (pixels.unsqueeze(1) - self.pixel_mean) / self.pixel_std
        x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed  # (rows, patches, dim)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


@dataclass
class DigitsObjective:
    """Softmax cross-entropy; accuracy picks checkpoints/best."""
    num_classes: int
    best_metric = "acc"

    def forward(self, model, batch: dict) -> torch.Tensor:
        return model(batch["pixels"])

    def loss(self, logits: torch.Tensor, batch: dict, reduction: str = "mean") -> torch.Tensor:
        return F.cross_entropy(logits.float(), batch["labels"], reduction=reduction)

    def make_metrics(self) -> MetricCollection:
        # validate_args off: its checks read values back to the host on every update
        return MetricCollection({"acc": MulticlassAccuracy(self.num_classes, average="micro", validate_args=False)})

    def is_better(self, value: float, best: float | None) -> bool:
        return best is None or value > best

    def predict(self, logits: torch.Tensor, batch: dict) -> dict[str, torch.Tensor]:
        """Each image's digit, the predicted one and its probability."""
        score, predicted = logits.float().softmax(dim=-1).max(dim=-1)
        return {"label": batch["labels"], "predicted": predicted, "score": score}


def load_exported(folder: str | Path) -> tuple[ViT, list[str]]:
    """The exported model in eval mode, taking raw (rows, 8, 8) pixels, and its class names in logit order."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    model = ViT(**config["architecture"])
    model.load_state_dict(torch.load(folder / "model.pt", map_location="cpu", weights_only=True))
    return model.eval(), config["classes"]
