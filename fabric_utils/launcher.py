"""The ``lightning.Fabric`` of the launch flags, or of ``fabric run``'s settings, and its processes."""

import contextlib
import os
import signal
import subprocess
import time
import warnings
from functools import partial
from pathlib import Path

import torch
from lightning.fabric import Fabric
from lightning.fabric.accelerators import ACCELERATOR_REGISTRY
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from fabric_utils import strategy as strategy_in_use
from fabric_utils.args import FP8, FSDP1, FSDP1_OFFLOAD, FSDP2, LAUNCH_DEFAULTS, launched_by_cli
from fabric_utils.errors import PeerLost, UserError, first_line, lost_a_peer
from fabric_utils.private import cluster_environment
from fabric_utils.progress import say
from fabric_utils.sharding import mixed_precision_policy, shard_blocks


def launch(fabric: Fabric) -> None:
    """Fabric step 2: start the processes; under ``fabric run`` they exist already."""
    if not launched_by_cli():
        if "TORCHELASTIC_RESTART_COUNT" in os.environ:
            from fabric_utils.other_launchers import join_restarted_torchrun_workers
            join_restarted_torchrun_workers(fabric)
        fabric.launch()


@contextlib.contextmanager
def explain_lost_peers(fabric: Fabric):
    """A collective failed as another process ended: a ``PeerLost`` saying which and how, where this one started it."""
    try:
        yield
    except Exception as err:
        if not lost_a_peer(err):
            raise
        procs = getattr(getattr(fabric.strategy, "launcher", None), "procs", [])
        ended = []
        for local_rank, proc in enumerate(procs, start=1):
            with contextlib.suppress(subprocess.TimeoutExpired):  # a peer's sockets close as it dies: a moment to go
                proc.wait(timeout=1)
            if proc.returncode:
                how = (f"was killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
                       else f"exited with status {proc.returncode}")
                ended.append(f"rank {fabric.node_rank * (len(procs) + 1) + local_rank}'s process {how}")
        raise PeerLost("; ".join(ended) or "another process of this job ended") from err


def end_job(fabric: Fabric) -> None:
    """A barrier, then the process group destroyed: left to teardown, gloo's threads can kill a finished process."""
    if torch.distributed.is_initialized():
        fabric.barrier()
        time.sleep(0.1)  # gloo's workers may need the GIL, which the group's destructor holds while it joins them
        torch.distributed.destroy_process_group()


def resolve_launch_settings(flags: dict) -> dict:
    """The five settings Fabric gets: ``fabric run``'s, else ``flags`` (None: not given), else the defaults."""
    from_cli = {}
    if launched_by_cli():
        from fabric_utils.fabric_run import fabric_run_settings
        from_cli = fabric_run_settings(flags)
    settings = {name: from_cli.get(name, default if flags.get(name) is None else flags[name])
                for name, default in LAUNCH_DEFAULTS.items()}
    settings["num_nodes"] = int(settings["num_nodes"])
    if settings["strategy"] == FSDP1_OFFLOAD:
        raise UserError(f"--strategy {FSDP1_OFFLOAD} ran torch's FSDP1, which this template no longer carries: use "
                        f"--strategy {FSDP2} (each device holds a share of the model), or a ZeRO offload strategy "
                        f"(--help lists them) to keep the optimizer state in CPU memory")
    if settings["strategy"] == FSDP1:  # fully_shard shards as FSDP1 did (FULL_SHARD)
        say(f"--strategy {FSDP1} runs as --strategy {FSDP2} (torch's fully_shard, which replaces FSDP1)")
        settings["strategy"] = FSDP2
    if settings["precision"] == "auto":
        settings["precision"] = auto_precision(settings["accelerator"], settings["strategy"])
    if settings["precision"] == FP8:  # Fabric runs the layers left in bf16 autocast
        settings["precision"] = "bf16-mixed"
    return settings


def auto_precision(accelerator: str, strategy: str = "auto") -> str:
    """bf16-mixed where it runs faster than fp32, 16-mixed on older GPUs (fsdp2 has no loss scaler), else fp32."""
    if accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available()):
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "bf16-mixed"
        return "32-true" if strategy == FSDP2 else "16-mixed"
    return "bf16-mixed" if accelerator in ("cpu", "auto") and cpu_has_fast_bf16() else "32-true"


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """Intel's AMX or AMD's AVX512-BF16 (Intel's AVX512-BF16 alone trains slower than fp32)."""
    try:
        flags = set((cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()).split())
    except OSError:  # not Linux: fp32 is the safe choice
        return False
    return "amx_bf16" in flags or {"AuthenticAMD", "avx512_bf16"} <= flags


CLUSTER_ENVIRONMENT = "FABRIC_TEMPLATE_CLUSTER"  # names a launcher whose processes Fabric cannot tell from its own


def build_fabric(accelerator=None, devices=None, num_nodes=None, strategy=None, precision=None, grad_clip=0.0,
                 grad_checkpointing=False, **fabric_kwargs) -> Fabric:
    """The Fabric of the launch flags (None: not given); a setting Fabric rejects is a one-line ``UserError``."""
    settings = resolve_launch_settings(dict(accelerator=accelerator, devices=devices, num_nodes=num_nodes,
                                            strategy=strategy, precision=precision))
    if os.environ.get(CLUSTER_ENVIRONMENT):
        from fabric_utils.other_launchers import named_cluster_environment
        fabric_kwargs["plugins"] = [*(fabric_kwargs.get("plugins") or []), named_cluster_environment()]
    try:
        strategy = build_strategy(settings, grad_checkpointing)
        if not isinstance(strategy, str):  # Fabric would take `fabric run`'s LT_STRATEGY (in settings) over it
            os.environ.pop("LT_STRATEGY", None)
        with warnings.catch_warnings():  # check_precision_supported says these in one line
            warnings.filterwarnings("ignore", message=".*AMP with fp16 is not supported on CPU")
            warnings.filterwarnings("ignore", message=".*is supported for historical reasons")
            fabric = Fabric(**{**settings, "strategy": strategy}, **fabric_kwargs)
    except (ValueError, RuntimeError, TypeError, MisconfigurationException) as err:
        raise UserError(f"cannot launch with {settings}: {first_line(err)}") from err
    environment = cluster_environment(fabric)
    if environment.creates_processes_externally or "WORLD_SIZE" in os.environ:  # another launcher's processes
        from fabric_utils.other_launchers import check_world_size
        check_world_size(environment, settings)
    check_precision_supported(settings["precision"], fabric.strategy.precision.precision, fabric.device)
    if precision == FP8:
        from fabric_utils.fp8 import check_fp8_supported
        check_fp8_supported(fabric.device, settings["strategy"])
    if engine := strategy_in_use.engine(fabric):
        engine.configure(fabric, settings["strategy"], grad_clip)
    # CPU processes beyond the cores would crawl (torchrun and SLURM placed theirs already)
    if fabric.device.type == "cpu" and not environment.creates_processes_externally and not launched_by_cli():
        per_node, cores = fabric.world_size // settings["num_nodes"], len(os.sched_getaffinity(0))
        if per_node > cores:
            raise UserError(f"--devices {settings['devices']}: {per_node} CPU processes on {cores} cores would crawl; "
                            f"use --devices {cores} or fewer (or a GPU)")
    return fabric


def build_strategy(settings: dict, grad_checkpointing: bool):
    """The strategy's name, or for fsdp2 one that shards, and recomputes, each block as its own unit."""
    name = settings["strategy"]
    if name == FSDP2:
        return ModelParallelStrategy(partial(shard_blocks, grad_checkpointing=grad_checkpointing,
                                             mp_policy=mixed_precision_policy(settings["precision"])),
                                     data_parallel_size=count_processes(settings), tensor_parallel_size=1)
    return name


def count_processes(settings: dict) -> int:
    """The world size, as Fabric will count it: ModelParallelStrategy needs it first."""
    accelerator = settings["accelerator"]
    if accelerator in ("auto", "gpu"):
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    devices_of = type(ACCELERATOR_REGISTRY.get(accelerator))
    devices = devices_of.auto_device_count() if settings["devices"] == "auto" else settings["devices"]
    return settings["num_nodes"] * len(devices_of.get_parallel_devices(devices_of.parse_devices(devices)))


def check_precision_supported(precision: str, built: str, device: torch.device) -> None:
    """Fabric swaps 16-mixed for bf16 on CPUs (``built``) behind a warning, and runs bf16 on GPUs that emulate it."""
    precision = str(precision)
    if device.type == "cpu" and precision.startswith(("16", "transformer-engine")) and built != "16-mixed":
        raise UserError(f"--precision {precision} needs a CUDA GPU (fp16 with loss scaling); on a CPU use "
                        f"bf16-mixed or 32-true, or leave --precision auto")
    if device.type == "cuda" and precision.startswith("bf16") and not torch.cuda.is_bf16_supported(
            including_emulation=False):
        raise UserError(f"--precision {precision}: this GPU has no native bf16 (that needs compute capability 8.0+, "
                        f"e.g. A100 or H100); use 16-mixed or leave --precision auto")


def warn_if_updates_vanish(plugin: Precision, lr: float) -> None:
    """bf16 weights round away steps below 1/512 of their size, unless the engine keeps fp32 master weights."""
    if plugin.precision == "bf16-true" and not strategy_in_use.keeps_fp32_weights(plugin):
        rank_zero_warn(f"--precision bf16-true keeps the weights in bf16, which rounds away updates below 1/512 of a "
                       f"weight: at --lr {lr:g}, AdamW leaves weights larger than {512 * lr:.2g} unchanged; use "
                       f"bf16-mixed (bf16 compute, fp32 weights) unless memory forces bf16-true")
