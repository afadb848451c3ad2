"""A model bigger than one device: where the strategy shards, every rank builds an empty sharded skeleton and rank 0
alone the pretrained model, whose values go into each rank's shards."""

from typing import Callable
from unittest import mock

import torch
from torch import nn

from fabric_utils import strategy
from fabric_utils.progress import say
from fabric_utils.sharding import materialize, recompute_blocks


def build_model(fabric, build: Callable[[], nn.Module], build_skeleton: Callable[[], nn.Module] | None,
                pretrained: bool, grad_checkpointing: bool = False) -> tuple[nn.Module, Callable[[], nn.Module] | None]:
    """The model to set up, and what ``load_pretrained`` loads into it once sharded (None: nothing)."""
    model, source = _build(fabric, build, build_skeleton, pretrained)
    if grad_checkpointing and not strategy.checkpoints_blocks(fabric):
        recompute_blocks(model)
    return model, source


def _build(fabric, build, build_skeleton, pretrained: bool):
    """``build_model``'s model and source; every way, the build and then training draw the same random numbers."""
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
            return strategy.engine(fabric).build_zero3(fabric, build_skeleton, source if pretrained else None), None
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
    """Parameters made inside go on the meta device, buffers stay real: the build alone gives non-persistent ones."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    return mock.patch.object(nn.Module, "register_parameter", register_on_meta)


def load_pretrained(fabric, model, source: Callable[[], nn.Module]) -> None:
    """The pretrained values from rank 0 into the set-up fsdp2 ``model``'s shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    found = source() if fabric.global_rank == 0 else None
    set_model_state_dict(model._forward_module, found.state_dict() if found is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

