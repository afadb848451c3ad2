"""Sharded training: a model's repeated blocks become the units that FSDP (``--strategy fsdp``) and FSDP2
(``--strategy fsdp2``) gather and free one at a time, and whose activations ``--grad-checkpointing`` recomputes;
Fabric sets up model and optimizer in the order each strategy needs.

A block is a class the model names in ``_no_split_modules`` (Hugging Face models list their layer classes there for
device maps; ``declare_blocks`` sets it from the task's ``TaskSpec.blocks``). Sharding the whole model as one unit
instead gathers every weight at once for the whole forward: no memory saved over DDP, and no overlap of
communication with compute.
"""

from typing import Callable

import torch
from lightning.fabric.strategies import DeepSpeedStrategy, ModelParallelStrategy
from torch import nn
from torch.optim import Optimizer
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fabric_utils.errors import UserError
from fabric_utils.private import CheckpointWrapper, _unwrap_compiled, apply_activation_checkpointing, checkpoint_wrapper


def find_block_classes(model: nn.Module) -> tuple[type, ...]:
    """The classes of the model's transformer blocks: those it names in ``_no_split_modules``, else those of the
    modules held in its ``ModuleList``s (DistilBERT names none, but keeps its layers in one); none for a model
    without either."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        return tuple({type(module) for module in model.modules() if type(module).__name__ in names})
    return tuple({type(block) for blocks in model.modules() if isinstance(blocks, nn.ModuleList) for block in blocks})


def block_classes(model: nn.Module) -> tuple[type, ...]:
    """``find_block_classes``, for the strategies that cannot run without them."""
    found = find_block_classes(model)
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


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """Under bf16-mixed, FSDP2 gathers each unit's weights in bf16, the dtype autocast computes in (half the bytes of
    fp32), and reduce-scatters the gradients in fp32, so the sum over ranks does not round; the sharded weights,
    their gradients and the optimizer stay fp32. Other precisions gather the weights as they are."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_blocks(model: nn.Module, device_mesh, grad_checkpointing: bool,
                 mp_policy: MixedPrecisionPolicy) -> nn.Module:
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
            fully_shard(module, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    if any(param.is_meta for param in model.parameters()):  # a skeleton: each rank's shards get memory, no values
        materialize(model, torch.device("cpu") if mesh.device_type == "cpu"
                    else torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device()))
    return model


def materialize(module: nn.Module, device: torch.device, recurse: bool = True) -> None:
    """Memory on ``device`` for ``module``'s parameters on the meta device, their values unset (the pretrained
    values or a checkpoint fill them); its buffers, real already, keep their values."""
    buffers = {name: buffer.to(device) for name, buffer in module.named_buffers(recurse=recurse)}
    module.to_empty(device=device, recurse=recurse)
    with torch.no_grad():
        for name, buffer in module.named_buffers(recurse=recurse):
            buffer.copy_(buffers[name])


def materialize_unit(module: nn.Module) -> None:
    """FSDP's ``param_init_fn``, called on each module of a unit as the unit is wrapped, where a parameter is on
    the meta device: on the CPU, from where FSDP moves the unit to its device and shards it."""
    if any(param.is_meta for param in module.parameters(recurse=False)):
        materialize(module, torch.device("cpu"), recurse=False)


def gather_one_block_at_a_time(zero_config: dict, model: nn.Module) -> None:
    """ZeRO-3 gathers each module's weights for its forward and for its backward and frees them in between, as FSDP
    does with its units, but keeps a gathered weight that is used again within ``stage3_max_reuse_distance``
    parameters, 1e9 by default: after the first step (which records the order) every rank of a model under a
    billion parameters kept the whole model gathered, as much as a ddp rank holds. Its gradients go through a reduce
    bucket of Lightning's 2e8 elements, more than a small model's. Sized to the largest block instead (the largest
    module without children for a model without blocks): a rank holds about the block it computes and the next one,
    prefetched. Small weights (biases, norms: under ``stage3_param_persistence_threshold``) stay gathered."""
    blocks = find_block_classes(model)
    units = [module for module in model.modules()
             if isinstance(module, blocks) or (not blocks and next(module.children(), None) is None)]
    block = max(sum(full_shape(param).numel() for param in unit.parameters()) for unit in units)
    zero_config.update(stage3_max_reuse_distance=block, stage3_prefetch_bucket_size=block,
                       stage3_max_live_parameters=2 * block, reduce_bucket_size=block)


# the name parts that Fabric (``_forward_module``), FSDP, activation checkpointing and torch.compile insert into a
# parameter's name when they wrap the module holding it
WRAPPER_NAME_PARTS = frozenset({"_forward_module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def unwrapped_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAME_PARTS)


def full_shape(param: nn.Parameter) -> torch.Size:
    """A parameter's shape as the model defines it; under ZeRO-3 (``deepspeed.zero.Init``) the tensor is this rank's
    empty partition and DeepSpeed keeps the shape in ``ds_shape``."""
    return getattr(param, "ds_shape", param.shape)


def setup_model_and_optimizer(fabric, model: nn.Module,
                              make_optimizer: Callable[[nn.Module, dict[str, torch.Size]], Optimizer]):
    """Fabric step 3: returns the set-up model and optimizer, and the plain torch optimizer inside (a learning-rate
    schedule drives that one: DeepSpeed's wrapper is no torch Optimizer, but steps the same parameter groups).

    FSDP shards the model first, and the optimizer must hold the sharded parameters, so it is built on the set-up
    model; DeepSpeed builds its engine from model and optimizer together. ``make_optimizer(module, shapes)`` gets
    each parameter's shape before set-up by its name in ``module``: FSDP (not FSDP2) turns every parameter into a
    1-D slice of its unit's flat shard, so a rule by shape (no weight decay on biases and norms) must read it there.

    The weights become fp32 whatever dtype the pretrained file holds: mixed precision computes in 16 bits but must
    update fp32 weights (fp16 gradients cannot even be unscaled), and Fabric's precision converts from there where it
    keeps them in another dtype (bf16-true). They are cast before set-up, when each rank holds them whole anyway (a
    skeleton, fabric_utils/pretrained.py, is fp32 already and holds no values yet); FSDP2 casts each rank's shards
    after sharding instead, so no rank holds a bf16-saved model whole in fp32.
    DeepSpeed in 16 bits casts the weights to them itself and makes its fp32 master weights from those: a cast to
    fp32 first would change no value, and only add a whole fp32 copy to each rank's peak."""
    sharded_after = isinstance(fabric.strategy, ModelParallelStrategy)
    deepspeed_casts = (isinstance(fabric.strategy, DeepSpeedStrategy)
                       and fabric.strategy.precision.precision != "32-true")
    if not (sharded_after or deepspeed_casts):
        model.float()
    if isinstance(fabric.strategy, DeepSpeedStrategy):
        if fabric.strategy.zero_stage_3:
            gather_one_block_at_a_time(fabric.strategy.config["zero_optimization"], model)
        # DeepSpeed compiles the module inside its engine itself, its hooks left eager; Fabric would compile the
        # whole engine (its bookkeeping, ZeRO-3's parameter fetches) as it compiles a DDP wrapper
        model, compile_kwargs = _unwrap_compiled(model)
        optimizer = make_optimizer(model, {name: full_shape(param) for name, param in model.named_parameters()})
        model, fabric_optimizer = fabric.setup(model, optimizer)
        if compile_kwargs is not None:
            backend = {"backend": compile_kwargs.pop("backend")} if "backend" in compile_kwargs else {}
            fabric.strategy.model.compile(**backend, compile_kwargs=compile_kwargs)
    else:
        shapes = {unwrapped_name(name): full_shape(param) for name, param in model.named_parameters()}
        model = fabric.setup_module(model)
        if sharded_after:  # FSDP2 casts the shards (its _apply re-registers them); Fabric converted before sharding
            fabric.strategy.precision.convert_module(model.float())
        # ``model.module`` is the module given, with FSDP's units inserted: its names lead back to ``shapes``
        before = {id(param): shapes[unwrapped_name(name)] for name, param in model.module.named_parameters()}
        optimizer = make_optimizer(model, {name: before[id(param)] for name, param in model.named_parameters()})
        fabric_optimizer = fabric.setup_optimizers(optimizer)
    return model, fabric_optimizer, optimizer
