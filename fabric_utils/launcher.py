"""Map command-line flags to a ``lightning.Fabric``: accelerator, devices, num_nodes, strategy, precision.

The choices come from Fabric's own registries, so every strategy Fabric knows (``ddp``, ``fsdp``,
``deepspeed_stage_2_offload``, ...) works as a flag. Under ``fabric run`` the CLI's settings arrive as ``LT_*``
environment variables and win; giving the same setting to both ``fabric run`` and ``train.py`` with different
values stops with a message that says which to remove.
"""

import argparse
import os
import typing
from contextlib import contextmanager
from pathlib import Path

import torch
from lightning.fabric import Fabric
from lightning.fabric.accelerators import ACCELERATOR_REGISTRY
from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR, _PRECISION_INPUT_STR_ALIAS
from lightning.fabric.strategies import STRATEGY_REGISTRY, DeepSpeedStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.exceptions import MisconfigurationException

from fabric_utils.errors import UserError

LAUNCH_SETTINGS = ("accelerator", "devices", "num_nodes", "strategy", "precision")
FABRIC_DEFAULTS = {"accelerator": "auto", "devices": "auto", "num_nodes": 1, "strategy": "auto"}
PRECISIONS = ("auto", *typing.get_args(_PRECISION_INPUT_STR), *typing.get_args(_PRECISION_INPUT_STR_ALIAS))


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("launch (as in `fabric run`; under `fabric run`, pass them there instead)")
    group.add_argument("--accelerator", choices=("auto", *ACCELERATOR_REGISTRY.available_accelerators()),
                       help="hardware to run on (default: auto)")
    group.add_argument("--devices", help="devices per node: a count (4), a list (0,1), -1 or auto (default)")
    group.add_argument("--num-nodes", type=int, help="number of machines (default: 1)")
    group.add_argument("--strategy", choices=("auto", *STRATEGY_REGISTRY.available_strategies()),
                       help="how to spread the work: ddp, fsdp, deepspeed_stage_2, ... (default: auto)")
    group.add_argument("--precision", choices=PRECISIONS,
                       help="numeric precision (default: auto = bf16-mixed where the hardware supports it, "
                            "16-mixed on older GPUs, else 32-true)")


def launched_by_cli() -> bool:
    return os.environ.get("LT_CLI_USED") == "1"


def launch(fabric: Fabric) -> None:
    """Fabric step 2: start the processes. Under ``fabric run`` they exist already, and Fabric joined them into
    one job when it was built (it refuses a second launch)."""
    if not launched_by_cli():
        fabric.launch()


def cli_settings() -> dict:
    """Settings given to ``fabric run``, which passes them on as ``LT_*`` environment variables."""
    if not launched_by_cli():
        return {}
    return {name: os.environ[f"LT_{name.upper()}"] for name in LAUNCH_SETTINGS if f"LT_{name.upper()}" in os.environ}


def resolve_launch_settings(args: argparse.Namespace) -> dict:
    """The five settings Fabric gets: the CLI's where ``fabric run`` set them, else the flags, else defaults."""
    from_cli = cli_settings()
    settings = {}
    for name in LAUNCH_SETTINGS:
        given = getattr(args, name)
        if name in from_cli:
            if given is not None and str(given) != from_cli[name]:
                flag = "--" + name.replace("_", "-")
                raise UserError(f"{flag} is set twice: `fabric run` has {from_cli[name]} (its default if not given "
                                f"there) and train.py has {given}; remove {flag} from the train.py arguments")
            settings[name] = from_cli[name]
        else:
            settings[name] = given if given is not None else FABRIC_DEFAULTS.get(name, "auto")
    settings["num_nodes"] = int(settings["num_nodes"])
    if settings["precision"] == "auto":
        settings["precision"] = auto_precision(settings["accelerator"])
    return settings


def auto_precision(accelerator: str) -> str:
    """bf16 autocast where the hardware runs bf16 natively, fp16 with loss scaling on older GPUs, else fp32."""
    use_cuda = accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available())
    if use_cuda:
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    if accelerator in ("cpu", "auto") and cpu_has_native_bf16():
        return "bf16-mixed"
    return "32-true"


def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16: without them PyTorch emulates bf16 matrix products, slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:  # not Linux: no cheap way to tell, and fp32 is the safe choice
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def build_fabric(args: argparse.Namespace, **fabric_kwargs) -> Fabric:
    """Builds the Fabric; a setting Fabric rejects (16-mixed on CPU, 3 devices on a 1-GPU machine) becomes a
    one-line ``UserError``."""
    settings = resolve_launch_settings(args)
    try:
        fabric = Fabric(**settings, **fabric_kwargs)
    except (ValueError, RuntimeError, TypeError, MisconfigurationException) as err:
        raise UserError(f"cannot launch with {settings}: {str(err).splitlines()[0]}") from err
    check_precision_supported(settings["precision"], fabric.device)
    if isinstance(fabric.strategy, DeepSpeedStrategy):
        configure_deepspeed(fabric.strategy, args.grad_clip)
    return fabric


def check_precision_supported(precision: str, device: torch.device) -> None:
    """Fabric swaps fp16 for bf16 on CPUs behind a warning, and lets bf16 through on GPUs without it."""
    precision = str(precision)
    if device.type == "cpu" and precision.startswith(("16", "transformer-engine")):
        raise UserError(f"--precision {precision} needs a CUDA GPU (fp16 with loss scaling); on a CPU use "
                        f"bf16-mixed or 32-true, or leave --precision auto")
    if device.type == "cuda" and precision.startswith("bf16") and not torch.cuda.is_bf16_supported():
        raise UserError(f"--precision {precision}: this GPU has no bf16 support; use 16-mixed or leave "
                        f"--precision auto")


def configure_deepspeed(strategy: DeepSpeedStrategy, grad_clip: float) -> None:
    """DeepSpeed clips gradients inside its optimizer step, so the clip value goes into its config.

    Fabric calls the engine's backward but the ZeRO optimizer's own step, never ``engine.step()``, so the engine
    cannot count micro-batches itself; and Fabric's DeepSpeed strategy has no ``no_backward_sync``. This gives it
    one that tells the engine whether the coming backward ends the accumulation group, DeepSpeed's own
    ``set_gradient_accumulation_boundary``. ZeRO-1 then reduces the gradients once per optimizer step, in the last
    micro-batch's backward; ZeRO-2 and 3 keep only their shard of the gradients, so every backward reduce-scatters
    and the shards accumulate."""
    strategy.config["gradient_clipping"] = grad_clip
    strategy._backward_sync_control = _DeepSpeedAccumulationBoundary()


class _DeepSpeedAccumulationBoundary(_BackwardSyncControl):
    @contextmanager
    def no_backward_sync(self, module, enabled: bool):
        module.set_gradient_accumulation_boundary(not enabled)  # module: the DeepSpeedEngine
        yield


def offloads_optimizer(fabric: Fabric) -> bool:
    """ZeRO-Offload steps the optimizer on the CPU (or NVMe), where DeepSpeed accepts only its own CPU optimizers."""
    if not isinstance(fabric.strategy, DeepSpeedStrategy):
        return False
    offload = fabric.strategy.config.get("zero_optimization", {}).get("offload_optimizer", {})
    return offload.get("device") in ("cpu", "nvme")


def clips_in_loop(fabric: Fabric) -> bool:
    return not isinstance(fabric.strategy, DeepSpeedStrategy)
