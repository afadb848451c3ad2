"""``--strategy fsdp`` and ``fsdp_cpu_offload`` (torch's FSDP1): each of the model's blocks a unit of its own, a
skeleton's units given memory on the CPU, the pretrained values loaded one unit at a time; loaded only under them."""

import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY, FSDPStrategy
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from fabric_utils.pretrained import from_rank0, source_values
from fabric_utils.sharding import block_classes, materialize, unwrapped_name


def fsdp_strategy(name: str, grad_checkpointing: bool) -> FSDPStrategy:
    """Fabric's FSDP strategy ``name``, sharding, and recomputing, each block as its own unit."""
    blocks = BlockPolicy()
    return FSDPStrategy(**STRATEGY_REGISTRY[name]["init_params"], auto_wrap_policy=blocks,
                        activation_checkpointing_policy=blocks if grad_checkpointing else None,
                        param_init_fn=materialize_unit)


class BlockPolicy:
    """FSDP's wrap and checkpointing policy for the model's blocks, read off the root, which FSDP asks about first."""
    blocks = None

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if self.blocks is None:
            self.blocks = block_classes(module)
        return recurse or isinstance(module, self.blocks)


def materialize_unit(module: nn.Module) -> None:
    """FSDP's ``param_init_fn``: a skeleton's parameters get memory on the CPU, whence FSDP shards them."""
    if any(param.is_meta for param in module.parameters(recurse=False)):
        materialize(module, torch.device("cpu"), recurse=False)


def load_fsdp(module: nn.Module, source: nn.Module | None) -> None:
    """One FSDP unit's own parameters at a time, the root first (the first to gather becomes the root)."""
    found = source_values(source)
    for prefix, unit in module.named_modules():
        if not isinstance(unit, FSDP):
            continue
        inner = {id(param) for sub in unit.modules() if sub is not unit and isinstance(sub, FSDP)
                 for param in sub.parameters()}
        with FSDP.summon_full_params(unit, recurse=False, writeback=True):
            for name, param in unit.named_parameters(prefix=prefix):
                if id(param) not in inner:
                    from_rank0(param, found, unwrapped_name(name))
    for name, buffer in module.named_buffers():
        from_rank0(buffer, found, unwrapped_name(name))
