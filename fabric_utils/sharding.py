"""Sharded training: a model's repeated blocks become the units that FSDP (``--strategy fsdp``) and FSDP2
(``--strategy fsdp2``) gather and free one at a time, and whose activations ``--grad-checkpointing`` recomputes;
Fabric sets up model and optimizer in the order each strategy needs.

A block is a class the model names in ``_no_split_modules`` (Hugging Face models list their layer classes there for
device maps; ``declare_blocks`` sets it from the task's ``TaskSpec.blocks``). Sharding the whole model as one unit
instead gathers every weight at once for the whole forward: no memory saved over DDP, and no overlap of
communication with compute.
"""

from typing import Callable

from lightning.fabric.strategies import DeepSpeedStrategy
from torch import nn
from torch.optim import Optimizer
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointWrapper,
                                                                         apply_activation_checkpointing,
                                                                         checkpoint_wrapper)
from torch.distributed.fsdp import fully_shard

from fabric_utils.errors import UserError


def block_classes(model: nn.Module) -> tuple[type, ...]:
    """The classes of the model's transformer blocks: those it names in ``_no_split_modules``, else those of the
    modules held in its ``ModuleList``s (DistilBERT names none, but keeps its layers in one)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        found = {type(module) for module in model.modules() if type(module).__name__ in names}
    else:
        found = {type(block) for blocks in model.modules() if isinstance(blocks, nn.ModuleList) for block in blocks}
    if not found:
        raise UserError(f"cannot find the repeated blocks of {type(model).__name__} to shard or recompute one by "
                        f"one: the task names them in its TaskSpec's blocks; or use --strategy ddp")
    return tuple(found)


def declare_blocks(model: nn.Module, blocks: tuple[type, ...]) -> nn.Module:
    """Names the task's ``blocks`` where FSDP, FSDP2 and activation checkpointing look for them (the strategy was
    built before the model existed); without them the model's own ``_no_split_modules`` or ``ModuleList``s count."""
    if blocks:
        model._no_split_modules = sorted({block.__name__ for block in blocks})
    return model


def recompute_blocks(model: nn.Module) -> None:
    """``--grad-checkpointing`` outside FSDP and FSDP2 (which wrap the blocks they shard themselves): a model's own
    gradient checkpointing where it has one (Hugging Face models; their checkpoints keep their names), else each
    block wrapped to recompute its activations in backward."""
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    blocks = block_classes(model)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                   check_fn=lambda module: isinstance(module, blocks))


class BlockPolicy:
    """FSDP's ``auto_wrap_policy`` and ``activation_checkpointing_policy``: true for the model's blocks. Fabric takes
    the policy before the model exists; FSDP asks it about the root module first and then about each module below
    it, so the policy reads the block classes off that root."""

    def __init__(self):
        self.blocks = None

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if self.blocks is None:
            self.blocks = block_classes(module)
        return recurse or isinstance(module, self.blocks)


def shard_blocks(model: nn.Module, device_mesh, grad_checkpointing: bool) -> nn.Module:
    """The ``parallelize_fn`` of ``--strategy fsdp2``: ``fully_shard`` on each block, then on the root for the rest
    (embeddings, head). With ``grad_checkpointing`` each block is first wrapped to recompute its activations in
    backward, inside its own shard unit (the order torchtitan uses)."""
    blocks = block_classes(model)
    if grad_checkpointing:
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                       check_fn=lambda module: isinstance(module, blocks))
        blocks = (CheckpointWrapper,)
    mesh = device_mesh["data_parallel"]
    for module in reversed(list(model.modules())):  # innermost first: a parameter belongs to its innermost unit
        if isinstance(module, blocks):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def setup_model_and_optimizer(fabric, model: nn.Module, make_optimizer: Callable[[nn.Module], Optimizer]):
    """Fabric step 3: returns the set-up model and optimizer, and the plain torch optimizer inside (a learning-rate
    schedule drives that one: DeepSpeed's wrapper is no torch Optimizer, but steps the same parameter groups).

    FSDP shards the model first, and the optimizer must hold the sharded parameters, so it is built on the set-up
    model; DeepSpeed builds its engine from model and optimizer together."""
    if isinstance(fabric.strategy, DeepSpeedStrategy):
        optimizer = make_optimizer(model)
        model, fabric_optimizer = fabric.setup(model, optimizer)
    else:
        model = fabric.setup_module(model)
        optimizer = make_optimizer(model)
        fabric_optimizer = fabric.setup_optimizers(optimizer)
    return model, fabric_optimizer, optimizer
