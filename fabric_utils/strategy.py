"""What the loop and the helpers ask of the Fabric strategy in use, answered in one place: the only module that looks
at a strategy's type. ``fsdp2`` is Fabric's ModelParallelStrategy sharding with ``fully_shard`` (launcher.py)."""

from lightning.fabric.strategies import (DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy,
                                         SingleDeviceStrategy)

from fabric_utils.args import FP8


def uses_deepspeed(fabric) -> bool:
    return isinstance(fabric.strategy, DeepSpeedStrategy)


def uses_zero3(fabric) -> bool:
    """DeepSpeed ZeRO stage 3, which partitions each parameter over the ranks."""
    return uses_deepspeed(fabric) and bool(fabric.strategy.zero_stage_3)


def uses_fsdp2(fabric) -> bool:
    return isinstance(fabric.strategy, ModelParallelStrategy)


def deepspeed_config(fabric) -> dict:
    """DeepSpeed's config, which it reads as it sets up; empty under other strategies."""
    return fabric.strategy.config if uses_deepspeed(fabric) else {}


def shards_at_build(fabric) -> bool:
    """fsdp, fsdp2 and ZeRO-3 hold a share of each weight per rank, so every rank builds an empty skeleton."""
    return isinstance(fabric.strategy, (FSDPStrategy, ModelParallelStrategy)) or uses_zero3(fabric)


def checkpoints_blocks(fabric) -> bool:
    """fsdp and fsdp2 wrap the blocks they shard to recompute them (``--grad-checkpointing``); elsewhere the model
    does."""
    return isinstance(fabric.strategy, (FSDPStrategy, ModelParallelStrategy))


def builds_optimizer_after_setup(fabric) -> bool:
    """Whether the optimizer is built on the parameters set-up made (FSDP's shards, transformer-engine's layers):
    DeepSpeed's engine takes the model and its optimizer at once."""
    return not uses_deepspeed(fabric)


def clips_in_loop(fabric) -> bool:
    """DeepSpeed clips inside its optimizer step, at its config's value."""
    return not uses_deepspeed(fabric)


def scales_loss(fabric) -> bool:
    """16-mixed outside DeepSpeed (which scales in its engine): Fabric's GradScaler unscales before clipping, which
    optimizers with fused kernels refuse (they unscale inside their own step)."""
    return getattr(fabric.strategy.precision, "scaler", None) is not None


def offloads_optimizer(fabric) -> bool:
    """ZeRO-Offload steps the optimizer on the CPU (or NVMe), where DeepSpeed accepts only its own CPU optimizers."""
    offload = deepspeed_config(fabric).get("zero_optimization", {}).get("offload_optimizer", {})
    return offload.get("device") in ("cpu", "nvme")


def reshards_checkpoints(fabric) -> bool:
    """fsdp2's sharded checkpoints load on any number of processes; fsdp's and DeepSpeed's only on as many as wrote
    them."""
    return uses_fsdp2(fabric)


def fits_cuda_graphs(fabric) -> bool:
    """One CUDA device or DDP: sharded strategies gather parameters between kernels, which a CUDA graph cannot hold."""
    return fabric.device.type == "cuda" and isinstance(fabric.strategy, (SingleDeviceStrategy, DDPStrategy))


def precision_name(fabric, flag: str) -> str:
    """The precision the run computes in: Fabric's, or --precision fp8-mixed, which runs inside Fabric's bf16-mixed."""
    return FP8 if flag == FP8 else fabric.strategy.precision.precision
