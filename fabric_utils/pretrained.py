"""A model bigger than one device: under fsdp, fsdp2 and deepspeed_stage_3 every rank builds the task's skeleton sharded
and empty, and rank 0 alone the pretrained model, whose values go straight into each rank's shards; elsewhere every rank
holds the whole model anyway and builds it from the pretrained file."""

from typing import Callable
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from fabric_utils import strategy
from fabric_utils.progress import say
from fabric_utils.sharding import materialize, recompute_blocks, unwrapped_name


def build_model(fabric, build: Callable[[], nn.Module], build_skeleton: Callable[[], nn.Module] | None,
                pretrained: bool, grad_checkpointing: bool = False) -> tuple[nn.Module, Callable[[], nn.Module] | None]:
    """The model to set up (recomputing its blocks' activations with ``grad_checkpointing``), and what
    ``load_pretrained`` loads into it once sharded: rank 0's pretrained builder, or None where the model has its values
    (built whole, ZeRO-3's partitions filled here) or a resume's checkpoint will."""
    model, source = _build(fabric, build, build_skeleton, pretrained)
    if grad_checkpointing and not strategy.checkpoints_blocks(fabric):
        recompute_blocks(model)  # FSDP and FSDP2 recompute the blocks they shard themselves
    return model, source


def _build(fabric, build, build_skeleton, pretrained: bool):
    """``build_model``'s model and source. Every way, the pretrained model (fresh head, adapters) and then training
    draw the same random numbers."""
    rng = torch.random.get_rng_state()

    def source() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.random.set_rng_state(rng)
            return build()

    sharded = strategy.shards_at_build(fabric)
    if build_skeleton is None or (pretrained and not sharded):
        return source(), None
    with torch.random.fork_rng(devices=[]):
        if strategy.uses_zero3(fabric):
            with fabric.init_module(empty_init=True):  # deepspeed.zero.Init: partitioned as created
                model = build_skeleton()
            if pretrained:
                load_zero3(model, source() if fabric.global_rank == 0 else None)
            return model, None
        with fabric.init_module(empty_init=False), parameters_on_meta():
            model = build_skeleton()
    # tied weights: materialized one shard unit at a time, they would come apart
    if len(list(model.named_parameters(remove_duplicate=False))) > len(list(model.parameters())):
        say(f"{type(model).__name__} ties weights: every rank builds it whole")
        return source(), None
    if not sharded:
        materialize(model, fabric.device)
    return model, source if pretrained else None


def parameters_on_meta():
    """Every parameter made inside is on the meta device, as in accelerate's ``init_empty_weights``; buffers stay
    real, since the non-persistent ones (position ids, rotary tables) get their values from the build alone."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    return mock.patch.object(nn.Module, "register_parameter", register_on_meta)


def load_pretrained(fabric, model, source: Callable[[], nn.Module]) -> None:
    """The pretrained values from rank 0 into the set-up fsdp or fsdp2 ``model``'s shards, in the shards' dtype."""
    module = model._forward_module  # under fsdp the root unit, which must gather first
    found = source() if fabric.global_rank == 0 else None
    if strategy.uses_fsdp2(fabric):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        set_model_state_dict(module, found.state_dict() if found is not None else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    else:
        load_fsdp(module, found)


def load_fsdp(module: nn.Module, source: nn.Module | None) -> None:
    """One FSDP1 unit at a time, the root first (the first to gather becomes the root): the unit's own parameters
    gathered whole, filled from rank 0, and each rank keeps its shard of them."""
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


def load_zero3(model: nn.Module, source: nn.Module | None) -> None:
    """One module's parameters gathered whole at a time, filled from rank 0 and partitioned again, before set-up, where
    DeepSpeed makes its fp32 master weights of them."""
    import deepspeed

    found = source_values(source)
    for prefix, module in model.named_modules():
        params = dict(module.named_parameters(prefix=prefix, recurse=False))
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0), torch.no_grad():
            if found is not None:
                for name, param in params.items():
                    param.copy_(found[name])
    for name, buffer in model.named_buffers():
        from_rank0(buffer, found, name)


def source_values(source: nn.Module | None) -> dict[str, torch.Tensor] | None:
    """Every parameter and buffer by each of its names (tied ones too), the non-persistent buffers too; None off rank
    0."""
    return None if source is None else {**dict(source.named_parameters(remove_duplicate=False)),
                                        **dict(source.named_buffers(remove_duplicate=False))}


@torch.no_grad()
def from_rank0(target: torch.Tensor, found: dict[str, torch.Tensor] | None, name: str) -> None:
    if found is not None:
        target.copy_(found[name])
    dist.broadcast(target, src=0)
