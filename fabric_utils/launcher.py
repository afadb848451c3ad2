"""Map command-line flags to a ``lightning.Fabric``: accelerator, devices, num_nodes, strategy, precision.

Every strategy Fabric knows (``ddp``, ``fsdp``, ``deepspeed_stage_2_offload``, ...) works as a flag
(``fabric_utils.args`` lists them), except those that spawn or fork a function (``ddp_spawn``, ``ddp_fork``,
``ddp_notebook``, ``xla``, ``xla_fsdp``). Under ``fabric run`` the CLI's settings arrive as ``LT_*``
environment variables and win; giving the same setting to both ``fabric run`` and ``train.py`` with different
values stops with a message that says which to remove.
"""

import contextlib
import os
import signal
import subprocess
import time
import warnings
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from lightning.fabric import Fabric
from lightning.fabric.accelerators import ACCELERATOR_REGISTRY
from lightning.fabric.plugins.precision import DeepSpeedPrecision, Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.fabric.strategies import deepspeed as fabric_deepspeed
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from fabric_utils.args import FSDP2, LAUNCH_DEFAULTS, fabric_run_settings, launched_by_cli
from fabric_utils.errors import PeerLost, UserError, lost_a_peer
from fabric_utils.private import _BackwardSyncControl, set_backward_sync_control
from fabric_utils.sharding import BlockPolicy, materialize_unit, mixed_precision_policy, shard_blocks


def launch(fabric: Fabric) -> None:
    """Fabric step 2: start the processes. Under ``fabric run`` they exist already, and Fabric joined them into
    one job when it was built (it refuses a second launch)."""
    if not launched_by_cli():
        join_restarted_torchrun_workers(fabric)
        fabric.launch()


@contextmanager
def explain_lost_peers(fabric: Fabric):
    """A collective that failed because another process of the job ended becomes a ``PeerLost`` that says which
    process and how it ended, where this process started it (Lightning's launcher: local rank 0 starts the node's
    others) and so knows."""
    try:
        yield
    except Exception as err:
        if not lost_a_peer(err):
            raise
        ended = []
        for local_rank, proc in enumerate(getattr(getattr(fabric.strategy, "launcher", None), "procs", []), start=1):
            with contextlib.suppress(subprocess.TimeoutExpired):  # a peer's sockets close as it dies: a moment to go
                proc.wait(timeout=1)
            if proc.returncode:
                how = (f"was killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
                       else f"exited with status {proc.returncode}")
                ended.append(f"rank {fabric.node_rank * (len(fabric.strategy.launcher.procs) + 1) + local_rank}'s "
                             f"process {how}")
        raise PeerLost("; ".join(ended) or "another process of this job ended") from err


def end_job(fabric: Fabric) -> None:
    """The last step of every process of a job: a barrier (no collective left in flight on any rank), then the
    process group destroyed. Left to interpreter teardown, gloo's threads can kill a process in C++ ("terminate
    called without an active exception", exit 134) after its work is done."""
    if torch.distributed.is_initialized():
        fabric.barrier()
        # gloo's worker threads free each collective after its caller saw it finish, and freeing one that holds Python
        # tensors takes the GIL; the group's destructor joins those threads, holding the GIL when the group's last
        # holder (DDP's reducer, say) is freed. Had a worker not finished by then, the process would hang for good: a
        # moment without the GIL lets them finish
        time.sleep(0.1)
        torch.distributed.destroy_process_group()


def join_restarted_torchrun_workers(fabric: Fabric) -> None:
    """``torchrun --max-restarts N`` restarts every worker when one fails, but its rendezvous hands the new workers
    the first attempt's store, which still holds the addresses the dead workers published there: gloo connects to
    them and fails ("connectFullMesh ... Connection refused"). A restarted worker joins the process group under a
    key prefix of its own attempt instead; Fabric then finds the group made and uses it.

    The attempt is counted in that store, since ``TORCHELASTIC_RESTART_COUNT`` is counted per node: a node whose
    workers did not fail restarts them with the count unchanged, and would join under another prefix than the
    restarted node's. Every worker adds one as it starts, so attempt k's workers count k x world size + 1 onwards."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or torch.distributed.is_initialized():
        return
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    world_size = int(os.environ["WORLD_SIZE"])
    attempt = (store.add("fabric-template/workers-started", 1) - 1) // world_size
    if attempt == 0:
        return
    torch.distributed.init_process_group("nccl" if fabric.device.type == "cuda" else "gloo",
                                         store=torch.distributed.PrefixStore(f"attempt-{attempt}", store),
                                         rank=int(os.environ["RANK"]), world_size=world_size)


def resolve_launch_settings(flags: dict) -> dict:
    """The five settings Fabric gets: the CLI's where ``fabric run`` set them (``fabric_run_settings``), else
    ``flags`` (the script's own, None where not given), else the flags' defaults."""
    from_cli = fabric_run_settings(flags)
    settings = {}
    for name, default in LAUNCH_DEFAULTS.items():
        given = flags.get(name)
        settings[name] = from_cli.get(name, given if given is not None else default)
    settings["num_nodes"] = int(settings["num_nodes"])
    if settings["precision"] == "auto":
        settings["precision"] = auto_precision(settings["accelerator"], settings["strategy"])
    return settings


def auto_precision(accelerator: str, strategy: str = "auto") -> str:
    """bf16 autocast where the hardware runs it faster than fp32 (GPUs with native bf16, CPUs with AMX), fp16 with loss
    scaling on older GPUs, else fp32.
    ``torch.cuda.is_bf16_supported()`` alone also counts GPUs that only emulate bf16 (V100, T4). fsdp2 has no loss
    scaler (Fabric's ModelParallelStrategy refuses 16-mixed), so on those GPUs it gets fp32."""
    use_cuda = accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available())
    if use_cuda:
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "bf16-mixed"
        return "32-true" if strategy == FSDP2 else "16-mixed"
    if accelerator in ("cpu", "auto") and cpu_has_amx():
        return "bf16-mixed"
    return "32-true"


def cpu_has_amx() -> bool:
    """AMX (its bf16 tiles): the CPUs on which bf16-mixed trains faster than fp32. AVX512-BF16 alone is not enough:
    on a Xeon with it and no AMX, bf16-mixed trained slower than fp32; with neither, PyTorch emulates bf16 matrix
    products."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:  # not Linux: no cheap way to tell, and fp32 is the safe choice
        return False
    return "amx_bf16" in flags


def build_fabric(accelerator=None, devices=None, num_nodes=None, strategy=None, precision=None, grad_clip=0.0,
                 grad_checkpointing=False, **fabric_kwargs) -> Fabric:
    """Builds the Fabric from the launch flags (None: not given); a setting Fabric rejects (16-mixed on CPU,
    3 devices on a 1-GPU machine) becomes a one-line ``UserError``. ``grad_clip`` goes into DeepSpeed's config,
    which clips inside its optimizer step; FSDP and FSDP2 do ``grad_checkpointing`` themselves."""
    settings = resolve_launch_settings(dict(accelerator=accelerator, devices=devices, num_nodes=num_nodes,
                                            strategy=strategy, precision=precision))
    try:
        strategy = build_strategy(settings, grad_checkpointing)
        if not isinstance(strategy, str):  # Fabric would take `fabric run`'s LT_STRATEGY (in settings) over it
            os.environ.pop("LT_STRATEGY", None)
        with warnings.catch_warnings():  # check_precision_supported makes this swap an error, in one line
            warnings.filterwarnings("ignore", message=".*AMP with fp16 is not supported on CPU")
            fabric = Fabric(**{**settings, "strategy": strategy}, **fabric_kwargs)
    except (ValueError, RuntimeError, TypeError, MisconfigurationException) as err:
        raise UserError(f"cannot launch with {settings}: {str(err).splitlines()[0]}") from err
    check_precision_supported(settings["precision"], fabric.strategy.precision.precision, fabric.device)
    check_strategy_supported(fabric, settings["strategy"])
    check_cpu_processes(fabric, settings)
    if isinstance(fabric.strategy, DeepSpeedStrategy):
        configure_deepspeed(fabric.strategy, grad_clip)
    return fabric


def build_strategy(settings: dict, grad_checkpointing: bool):
    """The strategy name, or for FSDP a strategy that shards each transformer block as its own unit (Fabric's
    default shards the whole model as one) and, with --grad-checkpointing, recomputes the blocks itself (Hugging
    Face's own checkpointing conflicts with FSDP). ``fsdp2`` puts every process in one sharding group."""
    name = settings["strategy"]
    if name == FSDP2:
        return ModelParallelStrategy(partial(shard_blocks, grad_checkpointing=grad_checkpointing,
                                             mp_policy=mixed_precision_policy(settings["precision"])),
                                     data_parallel_size=count_processes(settings), tensor_parallel_size=1)
    if is_fsdp(name):
        blocks = BlockPolicy()
        return FSDPStrategy(**STRATEGY_REGISTRY[name]["init_params"], auto_wrap_policy=blocks,
                            activation_checkpointing_policy=blocks if grad_checkpointing else None,
                            param_init_fn=materialize_unit)
    return name


def is_fsdp(name: str) -> bool:
    """fsdp, fsdp_cpu_offload: Fabric's registered names for the classic FSDP strategy."""
    return name in STRATEGY_REGISTRY and STRATEGY_REGISTRY[name]["strategy"] is FSDPStrategy


def strategy_checkpoints_blocks(strategy) -> bool:
    """Whether --grad-checkpointing is the strategy's job (FSDP, FSDP2) rather than the model's."""
    return isinstance(strategy, (FSDPStrategy, ModelParallelStrategy))


def count_processes(settings: dict) -> int:
    """The world size Fabric makes of these settings, counted as its connector does; ModelParallelStrategy needs
    it before Fabric is built."""
    accelerator = settings["accelerator"]
    if accelerator in ("auto", "gpu"):
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    devices_of = type(ACCELERATOR_REGISTRY.get(accelerator))
    devices = devices_of.auto_device_count() if settings["devices"] == "auto" else settings["devices"]
    return settings["num_nodes"] * len(devices_of.get_parallel_devices(devices_of.parse_devices(devices)))


def check_strategy_supported(fabric: Fabric, strategy: str) -> None:
    """Fabric's DeepSpeed strategy refuses anything but CUDA only once each process has started, leaving a
    traceback per process and the other ranks running: checked here instead, against the accelerator class it
    checks (the tests' CPU shim replaces it)."""
    if isinstance(fabric.strategy, DeepSpeedStrategy) and not isinstance(fabric.accelerator,
                                                                         fabric_deepspeed.CUDAAccelerator):
        raise UserError(f"--strategy {strategy} needs CUDA GPUs (DeepSpeed); on a CPU use --strategy ddp, {FSDP2} "
                        f"or auto")


def check_cpu_processes(fabric: Fabric, settings: dict) -> None:
    """CPU processes that this script would start beyond the cores it may run on: each trains with its own threads,
    so the job would crawl (64 on 2 cores sat at start-up for minutes). A launcher that starts the processes itself
    (torchrun, SLURM) has placed them already."""
    environment = getattr(fabric.strategy, "cluster_environment", None)
    if (fabric.device.type != "cpu" or environment is None or environment.creates_processes_externally
            or launched_by_cli()):
        return
    per_node, cores = fabric.world_size // settings["num_nodes"], len(os.sched_getaffinity(0))
    if per_node > cores:
        raise UserError(f"--devices {settings['devices']}: {per_node} CPU processes on {cores} cores would crawl; "
                        f"use --devices {cores} or fewer (or a GPU)")


def check_precision_supported(precision: str, built: str, device: torch.device) -> None:
    """Fabric swaps 16-mixed for bf16-mixed on CPUs behind a warning (``built`` is what it chose; only the tests'
    CPU shim builds real fp16 there), and lets bf16 through on GPUs that only emulate it."""
    precision = str(precision)
    if device.type == "cpu" and precision.startswith(("16", "transformer-engine")) and built != "16-mixed":
        raise UserError(f"--precision {precision} needs a CUDA GPU (fp16 with loss scaling); on a CPU use "
                        f"bf16-mixed or 32-true, or leave --precision auto")
    if device.type == "cuda" and precision.startswith("bf16") and not torch.cuda.is_bf16_supported(
            including_emulation=False):
        raise UserError(f"--precision {precision}: this GPU has no native bf16 (that needs compute capability 8.0+, "
                        f"e.g. A100 or H100); use 16-mixed or leave --precision auto")


def warn_if_updates_vanish(plugin: Precision, lr: float) -> None:
    """bf16 holds 8 significant bits, so bf16 weights round away any step below 1/512 of their size: at fine-tuning
    learning rates most weights of a pretrained model never move (DeepSpeed keeps fp32 master weights; the plain
    and FSDP plugins do not)."""
    if plugin.precision == "bf16-true" and not isinstance(plugin, DeepSpeedPrecision):
        rank_zero_warn(f"--precision bf16-true keeps the weights in bf16, which rounds away updates below 1/512 of a "
                       f"weight: at --lr {lr:g}, AdamW leaves weights larger than {512 * lr:.2g} unchanged; use "
                       f"bf16-mixed (bf16 compute, fp32 weights) unless memory forces bf16-true")


def configure_deepspeed(strategy: DeepSpeedStrategy, grad_clip: float) -> None:
    """DeepSpeed clips gradients inside its optimizer step, so the clip value goes into its config.

    Fabric calls the engine's backward but the ZeRO optimizer's own step, never ``engine.step()``, so the engine
    cannot count micro-batches itself; and Fabric's DeepSpeed strategy has no ``no_backward_sync``. This gives it
    one that tells the engine whether the coming backward ends the accumulation group, DeepSpeed's own
    ``set_gradient_accumulation_boundary``. ZeRO-1 then reduces the gradients once per optimizer step, in the last
    micro-batch's backward; ZeRO-2 and 3 keep only their shard of the gradients, so every backward reduce-scatters
    and the shards accumulate. Under bf16 those shards would be bf16 (DeepSpeed accumulates in the weights' dtype
    unless told), rounding the sum to 8 bits at every micro-batch: fp32 instead. Not under ZeRO-1, which adds the
    micro-batches up in the bf16 ``.grad`` as plain autograd does: asked for fp32 there, DeepSpeed swaps in its
    BF16_Optimizer, whose checkpoints its own zero_to_fp32 cannot read back, so export would fail."""
    strategy.config["gradient_clipping"] = grad_clip
    if strategy.precision.precision.startswith("bf16") and strategy.config["zero_optimization"]["stage"] >= 2:
        strategy.config.setdefault("data_types", {})["grad_accum_dtype"] = "fp32"
    set_backward_sync_control(strategy, _DeepSpeedAccumulationBoundary())


class _DeepSpeedAccumulationBoundary(_BackwardSyncControl):
    @contextmanager
    def no_backward_sync(self, module, enabled: bool):
        module.set_gradient_accumulation_boundary(not enabled)  # module: the DeepSpeedEngine
        yield


def scales_loss(fabric: Fabric) -> bool:
    """16-mixed (outside DeepSpeed, which scales inside its engine): Fabric's GradScaler unscales the gradients
    before clipping them, which optimizers with fused kernels refuse, as they unscale inside their own step."""
    return getattr(fabric.strategy.precision, "scaler", None) is not None


def offloads_optimizer(fabric: Fabric) -> bool:
    """ZeRO-Offload steps the optimizer on the CPU (or NVMe), where DeepSpeed accepts only its own CPU optimizers."""
    if not isinstance(fabric.strategy, DeepSpeedStrategy):
        return False
    offload = fabric.strategy.config.get("zero_optimization", {}).get("offload_optimizer", {})
    return offload.get("device") in ("cpu", "nvme")


def clips_in_loop(fabric: Fabric) -> bool:
    return not isinstance(fabric.strategy, DeepSpeedStrategy)
