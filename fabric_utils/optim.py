"""Optimizer and learning-rate schedule."""

import math

import torch


def build_optimizer(model, name: str, lr: float, weight_decay: float, device: torch.device,
                    offload: bool = False, loss_scaling: bool = False,
                    shapes: dict[str, torch.Size] | None = None) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay, none on biases and norms) with fused kernels on CUDA and CPU (on a CPU, far
    faster than the multi-tensor kernel) and multi-tensor (foreach) kernels elsewhere; ``adam`` is plain Adam, with
    torch's default kernel. Under ``loss_scaling`` (16-mixed) AdamW keeps the
    foreach kernel: Fabric's loss scaler unscales before clipping, which fused kernels refuse. With ``offload``
    (DeepSpeed's ZeRO-Offload) the step runs on the CPU copy of the weights, where DeepSpeed accepts only its own
    vectorized CPU Adam: the same update, the same groups. ``shapes`` (by parameter name) are the shapes the
    parameters had before a strategy flattened them (``setup_model_and_optimizer`` hands them over): the groups are
    told apart by them."""
    adamw = name == "adamw"
    if adamw:
        decay, no_decay = [], []
        for param_name, param in model.named_parameters():
            if param.requires_grad:
                ndim = len(shapes[param_name]) if shapes else param.ndim
                (no_decay if ndim < 2 else decay).append(param)
        params = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    else:
        params = [param for param in model.parameters() if param.requires_grad]
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # builds its C++ op on first use (minutes, then cached)
        return DeepSpeedCPUAdam(params, lr=lr, adamw_mode=adamw)
    if not adamw:
        return torch.optim.Adam(params, lr=lr)
    kernel = {"fused": True} if device.type in ("cuda", "cpu") and not loss_scaling else {"foreach": True}
    return torch.optim.AdamW(params, lr=lr, **kernel)


def count_parameters(model) -> dict:
    """Trainable and all parameters of a model not yet set up: whole, on the meta device, or partitioned by ZeRO-3
    (``deepspeed.zero.Init``), which keeps each one's whole size in ``ds_numel``."""
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
    return {"trainable_params": sum(size for size, trainable in sizes if trainable),
            "total_params": sum(size for size, _ in sizes)}


def count_warmup_steps(warmup: float, max_steps: int) -> int:
    """A fraction of all steps below 1 (rounded up, as transformers does), else a step count."""
    return math.ceil(warmup * max_steps) if warmup < 1 else int(warmup)


def build_scheduler(optimizer, name: str, lr: float, max_steps: int, warmup_steps: int, min_lr_rate: float = 0.0):
    """Linear warm-up from 0, then linear decay, half a cosine, or the peak kept (``constant``: a fixed rate after
    any warm-up): the schedules of transformers' ``get_scheduler``. The decay ends at ``min_lr_rate`` x the
    peak (transformers' ``cosine_with_min_lr`` name). ``one-cycle`` is PyTorch's OneCycleLR with the warm-up as its
    rising phase."""
    if name == "one-cycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=max_steps,
                                                   pct_start=max(warmup_steps, 1) / max_steps)
    decay = {"linear": lambda progress: max(0.0, 1.0 - progress),
             "cosine": lambda progress: max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress))),
             "constant": lambda progress: 1.0}[name]

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        return min_lr_rate + (1.0 - min_lr_rate) * decay((step - warmup_steps) / max(1, max_steps - warmup_steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
