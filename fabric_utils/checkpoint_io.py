"""How a checkpoint's state reaches the disk and comes back: without the frozen parameters (LoRA's base, which a resume
rebuilds from its source), written in the background while training goes on (at most one save in flight), and never
started on a disk that cannot hold it."""

import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from lightning_utilities import apply_to_collection
from torch import nn

from fabric_utils import strategy
from fabric_utils.errors import UserError
from fabric_utils.private import _unwrap_compiled, _unwrap_objects
from fabric_utils.progress import say

META = "meta.pt"  # beside a sharded checkpoint's files: what is not a model or optimizer, as Fabric names it


def bare_module(model) -> nn.Module:
    """The user's module inside Fabric's wrapper and torch.compile's: the names its checkpoints use."""
    return _unwrap_compiled(getattr(model, "_original_module", model))[0]


def frozen_names(model) -> set[str]:
    """Every name (tied ones too) of the parameters that do not train."""
    return {name for name, p in bare_module(model).named_parameters(remove_duplicate=False) if not p.requires_grad}


class TrainedPart:
    """A model's state without its frozen parameters, for ``fabric.load``: they stay as the model was built."""

    def __init__(self, model):
        self.module, self.frozen = bare_module(model), frozen_names(model)

    def state_dict(self) -> dict:
        return {k: v for k, v in self.module.state_dict().items() if k not in self.frozen}

    def load_state_dict(self, state: dict) -> None:
        missing, unexpected = self.module.load_state_dict(state, strict=False)
        if unexpected or set(missing) - self.frozen:
            raise RuntimeError(f"the checkpoint's weights do not fit the model: missing "
                               f"{sorted(set(missing) - self.frozen)[:3]}, unexpected {sorted(unexpected)[:3]}")


def _cpu_copy(value):
    """``value`` with every tensor (and container) copied to the host: what a background write reads while training
    changes it."""
    return apply_to_collection(value, torch.Tensor, lambda tensor: tensor.detach().to("cpu", copy=True))


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor: this rank's shard
        return local.numel() * local.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class Staged(NamedTuple):
    """A state ready to write: ``nbytes`` on this rank (None: not known before writing), ``write(path, background)``,
    which starts the write and returns what completes it (to run in a thread: it makes no collective call), and
    whether it leaves out frozen parameters (``trained_only``)."""
    nbytes: int | None
    write: Callable[[Path, bool], Callable[[], None]]
    trained_only: bool


def stage(fabric, state: dict) -> Staged:
    """``state`` as the strategy writes it, without frozen parameters: fsdp2 through torch distributed checkpoint
    (asynchronously, its own gloo group); one process's file (single device, DDP) from a host copy; an engine's own
    format through ``fabric.save``, synchronously."""
    frozen = bool(frozen_names(state["model"]))
    if strategy.uses_fsdp2(fabric):
        return _stage_sharded(fabric, state, frozen)
    if strategy.writes_one_file(fabric):
        staged = {key: _cpu_copy(TrainedPart(obj).state_dict() if isinstance(obj, nn.Module)
                                 else obj.state_dict() if hasattr(obj, "state_dict") else obj)
                  for key, obj in state.items()} if fabric.is_global_zero else {}

        def write_file(path: Path, background: bool) -> Callable[[], None]:
            return (lambda: torch.save(staged, path)) if fabric.is_global_zero else (lambda: None)
        return Staged(_nbytes(staged), write_file, frozen)

    def write_engine(path: Path, background: bool) -> Callable[[], None]:
        fabric.save(path, state)
        return lambda: None
    return Staged(None, write_engine, frozen and strategy.engine_leaves_frozen_out(fabric))


_GROUP = None  # the gloo group of background saves: training's collectives keep the default one


def _sharded(state: dict, trained_only: bool) -> tuple[nn.Module, dict, dict]:
    """The module, ``state`` out of Fabric's wrappers, and what torch distributed checkpoint writes of it: the model's
    and each optimizer's state, by parameter name."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    module, plain = bare_module(state["model"]), _unwrap_objects(state)
    tensors = {"model": get_model_state_dict(module, options=StateDictOptions(ignore_frozen_params=trained_only)),
               **{k: get_optimizer_state_dict(module, v) for k, v in plain.items()
                  if isinstance(v, torch.optim.Optimizer)}}
    return module, plain, tensors


def _stage_sharded(fabric, state: dict, frozen: bool) -> Staged:
    from torch.distributed import checkpoint as dcp

    _, plain, tensors = _sharded(state, trained_only=True)
    meta = {k: _cpu_copy(v.state_dict() if hasattr(v, "state_dict") else v)
            for k, v in plain.items() if k not in tensors}

    def write(path: Path, background: bool) -> Callable[[], None]:
        global _GROUP
        path.mkdir(parents=True, exist_ok=True)
        if fabric.is_global_zero:
            torch.save(meta, path / META)
        if not background:
            dcp.save(tensors, checkpoint_id=path)
            return lambda: None
        if _GROUP is None:
            _GROUP = dist.new_group(backend="gloo")
        return dcp.async_save(tensors, checkpoint_id=path, process_group=_GROUP).result
    return Staged(_nbytes(tensors), write, frozen)


def read_state(fabric, path: Path, state: dict, trained_only: bool) -> None:
    """Fills ``state`` from ``path``, as ``fabric.load`` does; ``trained_only``: the checkpoint lacks the frozen
    parameters, which keep the values the model was built with."""
    if strategy.uses_fsdp2(fabric):
        _read_sharded(path, state, trained_only)
    elif strategy.writes_one_file(fabric):
        target = {k: TrainedPart(v) if trained_only and isinstance(v, nn.Module) else v for k, v in state.items()}
        fabric.load(path, target, weights_only=True)
        state.update({k: v for k, v in target.items() if not isinstance(v, TrainedPart)})
    else:
        fabric.load(path, state, strict=not trained_only, weights_only=True)  # the engine reads its module file


def _read_sharded(path: Path, state: dict, trained_only: bool) -> None:
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    module, plain, tensors = _sharded(state, trained_only)
    dcp.load(tensors, checkpoint_id=path)
    set_model_state_dict(module, tensors["model"], options=StateDictOptions(strict=not trained_only))
    for k in tensors.keys() - {"model"}:
        set_optimizer_state_dict(module, plain[k], tensors[k], options=StateDictOptions(cpu_offload=True))
    meta = torch.load(path / META, weights_only=True)
    for key in state.keys() - tensors.keys():
        if key not in meta:
            raise KeyError(f"the checkpoint has no {key!r}")
        if hasattr(state[key], "load_state_dict"):  # in place, as fabric.load restores the scheduler
            state[key].load_state_dict(meta[key])
        else:
            state[key] = meta[key]


def frozen_weights(fabric, model) -> dict[str, torch.Tensor]:
    """The frozen parameters whole on rank 0's host ({} elsewhere), outside ZeRO-3 with the trained ones (the
    checkpoint's values override): what a checkpoint of the trained part needs for an export. A collective call."""
    module, frozen = bare_module(model), frozen_names(model)
    if not frozen:
        return {}
    if strategy.uses_zero3(fabric):
        return strategy.engine(fabric).frozen_weights(fabric, module, frozen)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


_WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-save")  # at most one save in flight
_IN_FLIGHT: list[Future] = []


def start(land: Callable[[], None]) -> None:
    """Runs ``land`` (the rest of a save) in the writer's thread; ``wait_for_save`` waits for it."""
    _IN_FLIGHT.append(_WRITER.submit(land))


def wait_for_save(fabric) -> None:
    """Blocks until the save in flight (if any) is on disk on every rank; raises, on every rank, what failed in it."""
    error = _IN_FLIGHT.pop().exception() if _IN_FLIGHT else None
    # rank 0 commits, and alone writes one process's file: its error stops every rank
    failed = fabric.broadcast(None if error is None else (type(error) is UserError, str(error)))
    if error is not None and type(error) is not UserError:
        raise error
    if failed:
        user_error, message = failed
        raise UserError(message) if user_error else RuntimeError(f"rank 0 could not save a checkpoint: {message}")
    fabric.barrier()


def check_space(fabric, root: Path, tag: str, nbytes: int | None, last: Path | None) -> int | None:
    """The bytes checkpoint ``tag`` will take (``nbytes``, summed over ranks, or else as many as ``last``, the last of
    its kind, if there is one), refused with one line if the disk under ``root`` has fewer free; None if neither is
    known."""
    if nbytes is not None:
        total = int(fabric.all_reduce(torch.tensor(float(nbytes)), reduce_op="sum").item())
    else:
        total = folder_bytes(last) if last and last.exists() else None
    refused = None
    if fabric.is_global_zero and total is not None:
        free = shutil.disk_usage(root).free
        if free < total:
            refused = (f"the disk under {root} has {megabytes(free)} free, less than the {megabytes(total)} checkpoint "
                       f"{tag} needs: it was not written, and the checkpoints already there are untouched; free space "
                       f"(or pass --keep-last 1), then rerun with --resume auto")
    if refused := fabric.broadcast(refused):
        raise UserError(refused)
    return total


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def megabytes(nbytes: float) -> str:
    return next(f"{nbytes / scale:.1f} {unit}" for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "B"))
                if nbytes >= scale or unit == "B")


def model_bytes(model) -> int:
    """The whole model's parameters (under ZeRO-3 and fsdp2 too): about what an export of its weights takes."""
    return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in bare_module(model).parameters())


def say_disk_plan(root: Path, tag: str, nbytes: int, keep_last: int | None, model, trained_only: bool) -> None:
    """The first step checkpoint's line: what the run's checkpoints and its export will take, against the free disk."""
    export = model_bytes(model)
    kept = f"{keep_last} x {megabytes(nbytes)} (--keep-last)" if keep_last else f"{megabytes(nbytes)} each (all kept)"
    total = f"~{megabytes((keep_last or 1) * nbytes + nbytes + export)}{'' if keep_last else ' and more'}"
    what = "what trains only (the frozen base comes from its source)" if trained_only else "the whole model"
    say(f"checkpoint {tag}: {megabytes(nbytes)}, {what}; the run needs {total} under {root.parent}: step checkpoints "
        f"{kept}, the best model (at most as much) and the export (~{megabytes(export)}); "
        f"{megabytes(shutil.disk_usage(root).free)} free")
