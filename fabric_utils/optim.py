"""Optimizer and learning-rate schedule from flags."""

import math

import torch
from transformers import get_scheduler


def build_optimizer(model, args, device: torch.device, offload: bool = False) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay, none on biases and norms) with fused kernels on CUDA and multi-tensor
    (foreach) kernels elsewhere; ``--optimizer adam`` is the article's plain Adam. With ``offload`` (DeepSpeed's
    ZeRO-Offload) the step runs on the CPU copy of the weights, where DeepSpeed accepts only its own vectorized
    CPU Adam: the same update, the same groups."""
    adamw = args.optimizer == "adamw"
    if adamw:
        decay, no_decay = [], []
        for param in model.parameters():
            if param.requires_grad:
                (no_decay if param.ndim < 2 else decay).append(param)
        params = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    else:
        params = model.parameters()
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # builds its C++ op on first use (minutes, then cached)
        return DeepSpeedCPUAdam(params, lr=args.lr, adamw_mode=adamw)
    if not adamw:
        return torch.optim.Adam(params, lr=args.lr)
    kernel = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, lr=args.lr, **kernel)


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
