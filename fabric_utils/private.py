"""Every private Lightning and PyTorch API the template uses, each with why: any release may change them, so on an
upgrade this is the module to check (written against lightning 2.6 and torch 2.13)."""

# a base class for a strategy's ``no_backward_sync``, which one of Fabric's strategies lacks (strategy.engine gives it)
from lightning.fabric.strategies.strategy import _BackwardSyncControl
# Lightning's launcher for ``python train.py --devices N``: its children must exit before it kills them
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
# reads fsdp2's sharded checkpoint whole in one process, without a process group (the export)
from lightning.fabric.utilities.load import _load_distributed_checkpoint
# the eager module and compile arguments of a compiled one: an engine compiles inside itself, not around it
from lightning.fabric.wrappers import _unwrap_compiled
# the torch module and optimizer inside Fabric's wrappers, as fabric.save hands them to a strategy (checkpoint_io.py)
from lightning.fabric.wrappers import _unwrap_objects
# per-module activation checkpointing, which FSDP2 and torchtitan use: PyTorch keeps it only in this private module
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper, apply_activation_checkpointing)
# tensors with shapes and no memory that transformers treats as traced (it skips reading their values): FLOP counting
from torch._subclasses.fake_tensor import FakeTensorMode
# torch.compile's own counts: graphs compiled so far, recompiles included (Throughput counts those after warm-up)
from torch._dynamo.utils import counters as dynamo_counters
# whether torch.compile ties input sizes that happen to be equal (duck shapes): no public switch
from torch.fx.experimental import _config as shape_config
# a loader's worker processes, which a DataLoader has no public way to shut down (stop_workers)
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter


def set_backward_sync_control(strategy, control: _BackwardSyncControl) -> None:
    """What ``fabric.no_backward_sync`` calls for this strategy: Fabric reads it from this attribute only."""
    strategy._backward_sync_control = control


def cluster_environment(fabric):
    """The launcher's environment Fabric detected or was given: a single-device strategy keeps none."""
    return fabric._connector.cluster_environment


def stop_workers(loader) -> None:
    """Shuts down a loader's persistent worker processes, as Lightning's Trainer does at the end of a loop."""
    loader = getattr(loader, "_dataloader", loader)  # inside Fabric's wrapper
    if isinstance(getattr(loader, "_iterator", None), _MultiProcessingDataLoaderIter):
        loader._iterator._shutdown_workers()
        loader._iterator = None
