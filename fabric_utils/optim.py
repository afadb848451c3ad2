"""The optimizer: AdamW with fused kernels, no decay on biases and norms (train.py builds the schedule)."""

import torch

from fabric_utils.sharding import full_shape


def build_optimizer(model, name: str, lr: float, weight_decay: float, device: torch.device, cpu_adam=None,
                    loss_scaling: bool = False) -> torch.optim.Optimizer:
    """AdamW, no decay on biases and norms (by the shape the model defines, also of a sharded weight), fused where it
    can (a CPU too); ``adam`` is plain Adam; ``cpu_adam``: the class an optimizer offloaded to the CPU must be
    (``strategy.cpu_optimizer``)."""
    adamw = name == "adamw"
    if adamw:
        decay, no_decay = [], []
        for param in model.parameters():
            if param.requires_grad:
                (no_decay if len(full_shape(param)) < 2 else decay).append(param)
        params = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    else:
        params = [param for param in model.parameters() if param.requires_grad]
    if cpu_adam is not None:
        return cpu_adam(params, lr=lr, adamw_mode=adamw)
    if not adamw:
        return torch.optim.Adam(params, lr=lr)
    # a loss scaler's unscaling before clipping is refused by fused kernels
    kernel = {"fused": True} if device.type in ("cuda", "cpu") and not loss_scaling else {"foreach": True}
    return torch.optim.AdamW(params, lr=lr, **kernel)


def count_parameters(model) -> dict:
    """Trainable and all parameters, whole under ZeRO-3 too."""
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
    return {"trainable_params": sum(size for size, trainable in sizes if trainable),
            "total_params": sum(size for size, _ in sizes)}
