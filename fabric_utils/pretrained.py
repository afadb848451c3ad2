"""A model bigger than one device, started under the strategies made for it (fsdp, fsdp2, deepspeed_stage_3): every
rank builds the task's skeleton (``TaskSpec.build_skeleton``) already sharded, with no weight in it, and rank 0 alone
builds the pretrained model (``TaskSpec.build_model``), whose values go straight into each rank's shards: under ZeRO-3
one module at a time before set-up (DeepSpeed makes its fp32 master weights at set-up), under fsdp one FSDP unit at a
time and under fsdp2 one tensor at a time, both after sharding. No rank holds the whole model in its own memory; rank 0
reads the pretrained file, which transformers memory-maps (page cache: shared, and given back under pressure). Under
ddp, one device and ZeRO-1/2 every rank holds the whole model anyway and builds it from the pretrained file, as it
does for a task that gives no skeleton.
"""

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
from lightning.fabric.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from torch import nn

from fabric_utils.progress import say
from fabric_utils.sharding import materialize, unwrapped_name


def builds_sharded(strategy) -> bool:
    return isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)) or (
        isinstance(strategy, DeepSpeedStrategy) and strategy.zero_stage_3)


def build_model(fabric, build: Callable[[], nn.Module], build_skeleton: Callable[[], nn.Module] | None,
                pretrained: bool) -> tuple[nn.Module, Callable[[], nn.Module] | None]:
    """The model to set up, and what ``load_pretrained`` loads into it once it is sharded: None where the model
    holds its values already (built whole, or ZeRO-3's partitions, filled here) or where the checkpoint of a resume
    (not ``pretrained``) restores them, else the pretrained model's builder, for rank 0 alone. A resume reads no
    pretrained file under any strategy: every rank builds the skeleton with memory and no values. The pretrained
    model draws the random numbers (a fresh head, adapters) the whole build draws here, and training draws the
    same ones after any of these builds."""
    rng = torch.random.get_rng_state()

    def source() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.random.set_rng_state(rng)
            return build()

    sharded = builds_sharded(fabric.strategy)
    if build_skeleton is None or (pretrained and not sharded):
        return source(), None
    with torch.random.fork_rng(devices=[]):
        if sharded and isinstance(fabric.strategy, DeepSpeedStrategy):
            with fabric.init_module(empty_init=True):  # deepspeed.zero.Init: partitioned as created
                model = build_skeleton()
            if pretrained:
                load_zero3(model, source() if fabric.global_rank == 0 else None)
            return model, None
        with fabric.init_module(empty_init=False), parameters_on_meta():
            model = build_skeleton()
    if tied_parameters(model):  # materialized module by module (each shard unit's), a tied weight would come apart
        say(f"{type(model).__name__} ties weights: every rank builds it whole")
        return source(), None
    if not sharded:
        materialize(model, fabric.device)
    return model, source if pretrained else None


@contextlib.contextmanager
def parameters_on_meta():
    """Every parameter made inside is on the meta device (no memory, no values), as accelerate's
    ``init_empty_weights`` makes them; buffers stay real: the non-persistent ones (position ids, rotary tables)
    are in no state dict and no checkpoint, so only the build makes their values."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def tied_parameters(model: nn.Module) -> bool:
    return len(list(model.named_parameters(remove_duplicate=False))) > len(list(model.parameters()))


def load_pretrained(fabric, model, source: Callable[[], nn.Module]) -> None:
    """The pretrained values into the set-up fsdp or fsdp2 ``model``'s shards, from rank 0."""
    module = model._forward_module  # under fsdp the root unit, which must gather first
    found = source() if fabric.global_rank == 0 else None
    if isinstance(fabric.strategy, ModelParallelStrategy):
        load_fsdp2(module, found)
    else:
        load_fsdp(module, found)


def load_fsdp2(module: nn.Module, source: nn.Module | None) -> None:
    """Rank 0's state dict broadcast one tensor at a time, each rank keeping its shard, cast to the shard's dtype
    (fp32: the file's dtype is the source's, not the model's)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, source.state_dict() if source is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def load_fsdp(module: nn.Module, source: nn.Module | None) -> None:
    """One FSDP1 unit at a time, the root first (the first to gather becomes the root): the unit's own parameters
    gathered whole, filled from rank 0, and each rank keeps its shard of them."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

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
    """One module's parameters gathered whole at a time, filled from rank 0, and partitioned again."""
    import deepspeed

    found = source_values(source)
    for prefix, module in model.named_modules():
        params = dict(module.named_parameters(prefix=prefix, recurse=False))
        if not params:
            continue
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0), torch.no_grad():
            if found is not None:
                for name, param in params.items():
                    param.copy_(found[name])
    for name, buffer in model.named_buffers():
        from_rank0(buffer, found, name)


def source_values(source: nn.Module | None) -> dict[str, torch.Tensor] | None:
    """Every parameter and buffer by name, the non-persistent buffers too; None off rank 0."""
    return None if source is None else {**dict(source.named_parameters()), **dict(source.named_buffers())}


@torch.no_grad()
def from_rank0(target: torch.Tensor, found: dict[str, torch.Tensor] | None, name: str) -> None:
    if found is not None:
        target.copy_(found[name])
    dist.broadcast(target, src=0)
