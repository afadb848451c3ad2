"""Sharded training: a model's repeated blocks are the units FSDP gathers one at a time (one unit for the whole model
would save no memory over DDP) and ``--grad-checkpointing`` recomputes; and what strategies need around set-up."""

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fabric_utils import strategy
from fabric_utils.errors import UserError
from fabric_utils.private import CheckpointWrapper, apply_activation_checkpointing


def block_classes(model: nn.Module, required: bool = True) -> tuple[type, ...]:
    """The classes in the model's ``_no_split_modules`` (as Hugging Face's), else those in its ``ModuleList``s."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = tuple({type(module) for module in model.modules() if type(module).__name__ in names} if names else
                  {type(block) for blocks in model.modules() if isinstance(blocks, nn.ModuleList) for block in blocks})
    if required and not found:
        raise UserError(f"cannot find the repeated blocks of {type(model).__name__} to shard or recompute one by "
                        f"one: name their class in the model's _no_split_modules (a list of class names, as Hugging "
                        f"Face models do), or use --strategy ddp")
    return found


def recompute_blocks(model: nn.Module) -> None:
    """``--grad-checkpointing`` outside FSDP: the model's own where it has one (its names stay), else each block's."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers' newer name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    blocks = block_classes(model)
    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, blocks))


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """Under bf16-mixed, FSDP2 gathers weights in bf16 and reduces gradients in fp32, so their sum does not round."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_blocks(model: nn.Module, device_mesh, grad_checkpointing: bool,
                 mp_policy: MixedPrecisionPolicy) -> nn.Module:
    """``--strategy fsdp2``'s ``parallelize_fn``: ``fully_shard`` each block (recomputed inside it), then the root."""
    blocks = block_classes(model)
    if grad_checkpointing:
        apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, blocks))
        blocks = (CheckpointWrapper,)
    mesh = device_mesh["data_parallel"]
    for module in reversed(list(model.modules())):  # innermost first
        if isinstance(module, blocks):
            fully_shard(module, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    if any(param.is_meta for param in model.parameters()):  # a skeleton: its shards get memory
        materialize(model, torch.device(mesh.device_type))
    return model


def materialize(module: nn.Module, device: torch.device, recurse: bool = True) -> None:
    """Memory on ``device`` for parameters on the meta device, values unset; buffers keep theirs."""
    buffers = {name: buffer.to(device) for name, buffer in module.named_buffers(recurse=recurse)}
    module.to_empty(device=device, recurse=recurse)
    with torch.no_grad():
        for name, buffer in module.named_buffers(recurse=recurse):
            buffer.copy_(buffers[name])


def full_shape(param: nn.Parameter) -> torch.Size:
    """The shape the model defines, also of ZeRO-3's empty partitions."""
    return getattr(param, "ds_shape", param.shape)


def prepare_for_setup(fabric, model: nn.Module) -> tuple[nn.Module, dict | None]:
    """``model`` in fp32 for set-up, unless it is sharded later (FSDP2: ``cast_shards``), and an engine's
    ``torch.compile`` arguments (else None)."""
    if engine := strategy.engine(fabric):
        return engine.prepare_for_setup(fabric, model)
    if not strategy.uses_fsdp2(fabric):
        model.float()
    return model, None


def cast_shards(fabric, model: nn.Module) -> nn.Module:
    """Under FSDP2, the set-up ``model``'s shards cast to fp32, then to the precision's weights."""
    if strategy.uses_fsdp2(fabric):
        fabric.strategy.precision.convert_module(model.float())
    return model

