"""Optimizer and learning-rate schedule from flags."""

import math

import torch
from transformers import get_scheduler


def build_optimizer(model, args, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay, none on biases and norms) with fused kernels on CUDA and multi-tensor
    (foreach) kernels elsewhere; ``--optimizer adam`` is the article's plain Adam."""
    if args.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=args.lr)
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 else decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kernel = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=args.lr, **kernel)


def count_warmup_steps(warmup: float, max_steps: int) -> int:
    """A fraction of all steps below 1 (rounded up, as transformers does), else a step count."""
    return math.ceil(warmup * max_steps) if warmup < 1 else int(warmup)


def build_scheduler(optimizer, name: str, lr: float, max_steps: int, warmup_steps: int):
    """linear / cosine: warm up, then decay to 0 (transformers' schedules); one-cycle: PyTorch's OneCycleLR with the
    warm-up as its rising phase; constant: the article's fixed learning rate, after any warm-up."""
    if name == "one-cycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=max_steps,
                                                   pct_start=max(warmup_steps, 1) / max_steps)
    hf_name = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}[name]
    return get_scheduler(hf_name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=max_steps)
