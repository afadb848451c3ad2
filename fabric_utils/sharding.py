"""Sharded training: a model's repeated blocks (the classes in its ``_no_split_modules``, as in Hugging Face models) are
the units FSDP and FSDP2 gather one at a time and ``--grad-checkpointing`` recomputes: one unit for the whole model
would gather every weight at once, saving no memory over DDP. Also what FSDP2 and DeepSpeed need around Fabric's set-up
(``prepare_for_setup``)."""

import torch
from lightning.fabric.wrappers import is_wrapped
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fabric_utils import strategy
from fabric_utils.errors import UserError
from fabric_utils.private import CheckpointWrapper, _unwrap_compiled, apply_activation_checkpointing, checkpoint_wrapper


def block_classes(model: nn.Module, required: bool = True) -> tuple[type, ...]:
    """The classes the model names in ``_no_split_modules``, else those in its ``ModuleList``s (DistilBERT names none);
    finding none is a ``UserError`` where ``required`` (FSDP, FSDP2 and recomputing cannot run without them)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = tuple({type(module) for module in model.modules() if type(module).__name__ in names} if names else
                  {type(block) for blocks in model.modules() if isinstance(blocks, nn.ModuleList) for block in blocks})
    if required and not found:
        raise UserError(f"cannot find the repeated blocks of {type(model).__name__} to shard or recompute one by "
                        f"one: name their class in the model's _no_split_modules (a list of class names, as Hugging "
                        f"Face models do), or use --strategy ddp")
    return found


def recompute_blocks(model: nn.Module) -> None:
    """``--grad-checkpointing`` outside FSDP and FSDP2 (which wrap the blocks they shard themselves): the model's own
    where it has one (Hugging Face models: their checkpoints keep their names), else each block wrapped."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers' name where the older one warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    blocks = block_classes(model)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                   check_fn=lambda module: isinstance(module, blocks))


class BlockPolicy:
    """FSDP's ``auto_wrap_policy`` and ``activation_checkpointing_policy``, true for the model's blocks: Fabric takes
    it before the model exists, so it reads the block classes off the root, which FSDP asks about first."""
    blocks = None

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if self.blocks is None:
            self.blocks = block_classes(module)
        return recurse or isinstance(module, self.blocks)


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """Under bf16-mixed FSDP2 gathers weights in bf16, autocast's dtype (half the bytes), and reduce-scatters
    gradients in fp32 so the sum over ranks does not round; shards, gradients and optimizer stay fp32."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_blocks(model: nn.Module, device_mesh, grad_checkpointing: bool,
                 mp_policy: MixedPrecisionPolicy) -> nn.Module:
    """The ``parallelize_fn`` of ``--strategy fsdp2``: ``fully_shard`` on each block, then on the root for the rest;
    with ``grad_checkpointing`` each block is wrapped to recompute first, inside its own shard unit (as torchtitan)."""
    blocks = block_classes(model)
    if grad_checkpointing:
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                       check_fn=lambda module: isinstance(module, blocks))
        blocks = (CheckpointWrapper,)
    mesh = device_mesh["data_parallel"]
    for module in reversed(list(model.modules())):  # innermost first: a parameter belongs to its innermost unit
        if isinstance(module, blocks):
            fully_shard(module, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    if any(param.is_meta for param in model.parameters()):  # a skeleton: each rank's shards get memory, no values
        materialize(model, torch.device(mesh.device_type))  # no index: the current device, Fabric's for this rank
    return model


def materialize(module: nn.Module, device: torch.device, recurse: bool = True) -> None:
    """Memory on ``device`` for the parameters on the meta device, values unset (pretrained values or a checkpoint
    fill them); the buffers, real already, keep their values."""
    buffers = {name: buffer.to(device) for name, buffer in module.named_buffers(recurse=recurse)}
    module.to_empty(device=device, recurse=recurse)
    with torch.no_grad():
        for name, buffer in module.named_buffers(recurse=recurse):
            buffer.copy_(buffers[name])


def materialize_unit(module: nn.Module) -> None:
    """FSDP's ``param_init_fn``, called on each module of a unit being wrapped: a skeleton's parameters get memory on
    the CPU, from where FSDP moves the unit to its device and shards it."""
    if any(param.is_meta for param in module.parameters(recurse=False)):
        materialize(module, torch.device("cpu"), recurse=False)


def gather_one_block_at_a_time(zero_config: dict, model: nn.Module) -> None:
    """ZeRO-3's reuse distance, prefetch and buckets sized to the largest block (else leaf module): by default it keeps
    gathered any weight reused within 1e9 parameters, a whole smaller model, as much as a ddp rank holds."""
    blocks = block_classes(model, required=False)
    units = [module for module in model.modules()
             if isinstance(module, blocks) or (not blocks and next(module.children(), None) is None)]
    block = max(sum(full_shape(param).numel() for param in unit.parameters()) for unit in units)
    zero_config.update(stage3_max_reuse_distance=block, stage3_prefetch_bucket_size=block,
                       stage3_max_live_parameters=2 * block, reduce_bucket_size=block)


# what Fabric, FSDP, activation checkpointing and torch.compile insert into a parameter's name as they wrap its module
WRAPPER_NAME_PARTS = frozenset({"_forward_module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def unwrapped_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAME_PARTS)


def full_shape(param: nn.Parameter) -> torch.Size:
    """The shape the model defines; under ZeRO-3 the tensor is this rank's empty partition and ``ds_shape`` holds it."""
    return getattr(param, "ds_shape", param.shape)


def prepare_for_setup(fabric, model: nn.Module) -> tuple[nn.Module, dict | None]:
    """``model`` as Fabric's set-up takes it, and the ``torch.compile`` arguments ``compile_in_engine`` applies after
    (None: Fabric recompiles around its wrapper). Weights become fp32 for mixed precision to update, but never whole on
    a rank: FSDP2 casts its shards (``cast_shards``), DeepSpeed in 16 bits makes its own fp32 master weights."""
    deepspeed = strategy.uses_deepspeed(fabric)
    if not (strategy.uses_fsdp2(fabric) or deepspeed and fabric.strategy.precision.precision != "32-true"):
        model.float()
    if not deepspeed:
        return model, None
    if strategy.uses_zero3(fabric):
        gather_one_block_at_a_time(strategy.deepspeed_config(fabric)["zero_optimization"], model)
    # DeepSpeed compiles the module inside its engine, its hooks eager; Fabric would compile the whole engine
    return _unwrap_compiled(model)


def cast_shards(fabric, model: nn.Module) -> nn.Module:
    """The set-up ``model``, under FSDP2 its shards cast to fp32 and then to the precision's own weights (its _apply
    re-registers them: the optimizer is built after); Fabric converted the model before sharding it."""
    if strategy.uses_fsdp2(fabric):
        fabric.strategy.precision.convert_module(model.float())
    return model


def compile_in_engine(fabric, compile_kwargs: dict | None) -> None:
    """DeepSpeed's route for a compiled model (``prepare_for_setup``'s arguments): its engine compiles the module."""
    if compile_kwargs is not None:
        backend = {"backend": compile_kwargs.pop("backend")} if "backend" in compile_kwargs else {}
        fabric.strategy.model.compile(**backend, compile_kwargs=compile_kwargs)


def full_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """Each parameter's shape by its name without wrappers, taken before set-up: FSDP1 flattens the parameters."""
    return {unwrapped_name(name): full_shape(param) for name, param in model.named_parameters()}


def shapes_by_name(model: nn.Module, shapes: dict[str, torch.Size]) -> dict[str, torch.Size]:
    """``model``'s parameter names with their ``full_shapes``; once set up, found through ``model.module``, the module
    given, whose names lead back to them with FSDP's units inserted (the wrapper's own may not: DDP's ``module.``)."""
    given = model.module if is_wrapped(model) else model
    before = {id(param): shapes[unwrapped_name(name)] for name, param in given.named_parameters()}
    return {name: before[id(param)] for name, param in model.named_parameters()}
