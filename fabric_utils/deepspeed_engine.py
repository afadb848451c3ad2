"""DeepSpeed (``--strategy deepspeed*``): what its engine needs beyond Fabric, loaded only in a run that uses it
(``strategy.engine``): its config, the accumulation boundary, set-up and compile, ZeRO-3's build and pretrained load,
checkpoints without Adam's moments, the export's gather and ZeRO-Offload's CPU Adam."""

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric.strategies import deepspeed as fabric_deepspeed
from torch import nn

from fabric_utils.args import FSDP2
from fabric_utils.errors import UserError
from fabric_utils.private import _BackwardSyncControl, _unwrap_compiled, set_backward_sync_control
from fabric_utils.sharding import block_classes, full_shape

def configure(fabric, name: str, grad_clip: float) -> None:
    """Refuses a CPU; puts the clip value in DeepSpeed's config (it clips in its step), and gives Fabric a
    ``no_backward_sync`` that ends the engine's accumulation (Fabric never calls ``engine.step()``)."""
    # Fabric refuses DeepSpeed off CUDA only once each process started (the tests' CPU shim swaps the class)
    if not isinstance(fabric.accelerator, fabric_deepspeed.CUDAAccelerator):
        raise UserError(f"--strategy {name} needs CUDA GPUs (DeepSpeed); on a CPU use --strategy ddp, {FSDP2} or auto")
    config = fabric.strategy.config
    config["gradient_clipping"] = grad_clip
    # ZeRO-2/3 accumulate reduced shards: in fp32; ZeRO-1 would swap in BF16_Optimizer, whose checkpoints cannot export
    if fabric.strategy.precision.precision.startswith("bf16") and config["zero_optimization"]["stage"] >= 2:
        config.setdefault("data_types", {})["grad_accum_dtype"] = "fp32"
    set_backward_sync_control(fabric.strategy, _AccumulationBoundary())
    fabric.strategy.exclude_frozen_parameters = True  # checkpoints hold what trains, the engine's too


class _AccumulationBoundary(_BackwardSyncControl):
    @contextlib.contextmanager
    def no_backward_sync(self, module, enabled: bool):
        module.set_gradient_accumulation_boundary(not enabled)  # module: the DeepSpeedEngine
        yield


def prepare_for_setup(fabric, model: nn.Module) -> tuple[nn.Module, dict | None]:
    """``model`` in fp32 for set-up unless the engine keeps fp32 master weights of it, ZeRO-3's gathering sized to a
    block, and the ``torch.compile`` arguments for ``compile_in_engine`` (else None): Fabric would compile the whole
    engine, whose hooks stay eager inside."""
    if fabric.strategy.precision.precision == "32-true":
        model.float()
    if fabric.strategy.zero_stage_3:
        gather_one_block_at_a_time(fabric.strategy.config["zero_optimization"], model)
    return _unwrap_compiled(model)


def compile_in_engine(fabric, compile_kwargs: dict | None) -> None:
    """The engine compiles the module with ``prepare_for_setup``'s arguments."""
    if compile_kwargs is not None:
        backend = {"backend": compile_kwargs.pop("backend")} if "backend" in compile_kwargs else {}
        fabric.strategy.model.compile(**backend, compile_kwargs=compile_kwargs)


def gather_one_block_at_a_time(zero_config: dict, model: nn.Module) -> None:
    """ZeRO-3's reuse distance, prefetch and buckets sized to the largest block: its default keeps a small model
    gathered whole."""
    blocks = block_classes(model, required=False)
    units = [module for module in model.modules()
             if isinstance(module, blocks) or (not blocks and next(module.children(), None) is None)]
    block = max(sum(full_shape(param).numel() for param in unit.parameters()) for unit in units)
    zero_config.update(stage3_max_reuse_distance=block, stage3_prefetch_bucket_size=block,
                       stage3_max_live_parameters=2 * block, reduce_bucket_size=block)


def build_zero3(fabric, build_skeleton, source) -> nn.Module:
    """ZeRO-3's model, partitioned as created, with ``source``'s values (None: none) loaded from rank 0."""
    with fabric.init_module(empty_init=True):
        model = build_skeleton()
    if source is not None:
        load_zero3(model, source() if fabric.global_rank == 0 else None)
    return model


def load_zero3(model: nn.Module, source: nn.Module | None) -> None:
    """One module's parameters gathered at a time, before set-up makes fp32 master weights of them."""
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
    """Every parameter and buffer by each of its names (tied ones too), non-persistent ones too; None off rank 0."""
    return None if source is None else {**dict(source.named_parameters(remove_duplicate=False)),
                                        **dict(source.named_buffers(remove_duplicate=False))}


@torch.no_grad()
def from_rank0(target: torch.Tensor, found: dict[str, torch.Tensor] | None, name: str) -> None:
    if found is not None:
        target.copy_(found[name])
    dist.broadcast(target, src=0)


@contextlib.contextmanager
def without_adam_moments(fabric, state: dict):
    """DeepSpeed writes its optimizer whatever ``state`` holds: without one (``best``), leave out Adam's moments."""
    from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, OPTIMIZER_STATE_DICT
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer

    optimizer = fabric.strategy.model.optimizer  # the engine's ZeRO optimizer
    if any(isinstance(obj, (torch.optim.Optimizer, DeepSpeedOptimizer)) for obj in state.values()):
        yield
        return
    full = optimizer.state_dict

    def without_moments() -> dict:
        written = {k: v for k, v in full().items() if k != BASE_OPTIMIZER_STATE}
        if OPTIMIZER_STATE_DICT in written:
            written[OPTIMIZER_STATE_DICT] = {**written[OPTIMIZER_STATE_DICT], "state": {}}  # load_weights reads it
        return written

    optimizer.state_dict = without_moments
    try:
        yield
    finally:
        del optimizer.state_dict  # the class's own again


def frozen_weights(fabric, module: nn.Module, frozen: set[str]) -> dict[str, torch.Tensor]:
    """ZeRO-3's frozen parameters whole on rank 0's host ({} elsewhere), gathered one at a time: it never holds the
    model whole. A collective call."""
    import deepspeed

    fabric.strategy.model.empty_partition_cache()  # the last forward's prefetched weights: none in flight
    found = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if name in frozen:
            with deepspeed.zero.GatheredParameters([param]):
                if fabric.is_global_zero:
                    found[name] = param.detach().to("cpu", copy=True)
    return found


def full_state_dict(state_path: Path) -> dict:
    """ZeRO's fp32 master weights, plus the frozen ones (LoRA's base) it leaves out, whole in its module file."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    weights = get_fp32_state_dict_from_zero_checkpoint(str(state_path), tag="checkpoint")
    module_file = min((state_path / "checkpoint").glob("*model_states.pt"))  # ZeRO-3 writes one per rank
    module = torch.load(module_file, map_location="cpu", weights_only=True, mmap=True)["module"]
    weights.update({name: module[name] for name in module.keys() - weights.keys()})
    return weights


def cpu_adam():
    """ZeRO-Offload's optimizer class: it refuses torch's."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam


def pickled_classes() -> list:
    """What DeepSpeed's model and ZeRO files hold beside tensors, for safe_pickle.py's allow-list."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import LossScaler, DynamicLossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:  # then no DeepSpeed checkpoint can be resumed anyway
        return []
    return [ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler]
