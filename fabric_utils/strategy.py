"""What the strategy in use can do, answered in one place: the only module that looks at a strategy's type."""

import logging
import re

from lightning.fabric.plugins.precision import DeepSpeedPrecision
from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, SingleDeviceStrategy

from fabric_utils.args import FP8


def uses_deepspeed(fabric) -> bool:
    return isinstance(fabric.strategy, DeepSpeedStrategy)


def engine(fabric):
    """What DeepSpeed's engine needs beyond Fabric (deepspeed_engine.py), loaded where the run uses it; else None."""
    if not uses_deepspeed(fabric):
        return None
    from fabric_utils import deepspeed_engine
    return deepspeed_engine


def silence_engines() -> None:
    """transformers imports DeepSpeed where accelerate is installed, whatever the strategy: its accelerator guess is
    noise."""
    logging.getLogger("DeepSpeed").addFilter(lambda record: "Setting accelerator to" not in record.getMessage())


def pickled_classes(file_name: str) -> list:
    """What an engine's checkpoint file holds beside tensors (DeepSpeed's model and ZeRO files), for safe_pickle.py."""
    if not re.fullmatch(r".*_(model|optim)_states\.pt", file_name):
        return []
    from fabric_utils.deepspeed_engine import pickled_classes
    return pickled_classes()


def libraries(fabric) -> tuple[str, ...]:
    """The packages beyond torch and Lightning that run the strategy, whose versions a run records."""
    return ("deepspeed",) if uses_deepspeed(fabric) else ()


def uses_zero3(fabric) -> bool:
    return uses_deepspeed(fabric) and bool(fabric.strategy.zero_stage_3)


def engine_leaves_frozen_out(fabric) -> bool:
    """Whether the engine's own checkpoint leaves frozen parameters out: DeepSpeed's (deepspeed_engine.configure)."""
    return uses_deepspeed(fabric)


def uses_fsdp2(fabric) -> bool:
    return isinstance(fabric.strategy, ModelParallelStrategy)  # --strategy fsdp2 (launcher.py)


def shards_at_build(fabric) -> bool:
    """Each rank holds a share of each weight, so it builds an empty skeleton."""
    return checkpoints_blocks(fabric) or uses_zero3(fabric)


def checkpoints_blocks(fabric) -> bool:
    """fsdp2 recomputes (``--grad-checkpointing``) the blocks it shards; elsewhere the model does."""
    return uses_fsdp2(fabric)


def builds_optimizer_after_setup(fabric) -> bool:
    """On the parameters set-up made; DeepSpeed's engine takes the model and its optimizer at once."""
    return not uses_deepspeed(fabric)


def clips_in_loop(fabric) -> bool:
    """DeepSpeed clips inside its optimizer step."""
    return not uses_deepspeed(fabric)


def scales_loss(fabric) -> bool:
    """Fabric's GradScaler (16-mixed outside DeepSpeed), whose unscaling before clipping fused optimizers refuse."""
    return getattr(fabric.strategy.precision, "scaler", None) is not None


def offloads_optimizer(fabric) -> bool:
    """ZeRO-Offload, which accepts only DeepSpeed's own CPU optimizers."""
    config = fabric.strategy.config if uses_deepspeed(fabric) else {}
    return config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") in ("cpu", "nvme")


def cpu_optimizer(fabric):
    """The optimizer class ZeRO-Offload takes in place of torch's (DeepSpeed's CPU Adam), or None."""
    return engine(fabric).cpu_adam() if offloads_optimizer(fabric) else None


def keeps_fp32_weights(plugin) -> bool:
    """Whether a precision plugin updates fp32 master weights under bf16-true: DeepSpeed's alone."""
    return isinstance(plugin, DeepSpeedPrecision)


def writes_one_file(fabric) -> bool:
    """One process writes the checkpoint's state whole: one device, DDP (a copy of the model on each)."""
    return isinstance(fabric.strategy, (SingleDeviceStrategy, DDPStrategy)) and not uses_deepspeed(fabric)


def reshards_checkpoints(fabric) -> bool:
    """fsdp2's sharded checkpoints load on any number of processes; DeepSpeed's do not."""
    return uses_fsdp2(fabric)


def fits_cuda_graphs(fabric) -> bool:
    """Sharded strategies gather parameters between kernels, which a CUDA graph cannot hold."""
    return fabric.device.type == "cuda" and isinstance(fabric.strategy, (SingleDeviceStrategy, DDPStrategy))


def precision_name(fabric, flag: str) -> str:
    """Fabric's precision, or fp8-mixed, which runs inside Fabric's bf16-mixed."""
    return FP8 if flag == FP8 else fabric.strategy.precision.precision
