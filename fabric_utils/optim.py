"""The optimizer: AdamW with fused kernels, no decay on biases and norms (train.py builds the schedule)."""

import torch

from fabric_utils.sharding import shapes_by_name


def build_optimizer(model, name: str, lr: float, weight_decay: float, device: torch.device, offload: bool = False,
                    loss_scaling: bool = False, shapes: dict[str, torch.Size] | None = None) -> torch.optim.Optimizer:
    """AdamW, no decay on biases and norms (``shapes``: ``full_shapes``, before a strategy flattened them), with fused
    kernels (on a CPU too: far faster) but foreach off CUDA and CPU or under ``loss_scaling``, whose unscaling before
    clipping fused ones refuse. ``adam`` is plain Adam; ``offload`` (ZeRO-Offload) needs DeepSpeed's own CPU Adam."""
    adamw = name == "adamw"
    if adamw:
        decay, no_decay = [], []
        shapes = shapes and shapes_by_name(model, shapes)
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
    """Trainable and all parameters, whole, on meta or partitioned by ZeRO-3 (whose ``ds_numel`` is the whole size)."""
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
    return {"trainable_params": sum(size for size, trainable in sizes if trainable),
            "total_params": sum(size for size, _ in sizes)}
