"""Test-only script: trains tiny models through ``build_fabric`` with a DeepSpeed strategy on 2 CPU processes
(run it under the shim in sitecustomize.py) and writes what tests/test_deepspeed.py checks as JSON to OUT:

    warm_up: one step, with and without ``compiling.warm_up`` before it: the weights after it.
    accumulate: for --grad-accum 1, 2 and 4 over the same rows, train.py's loop (backward per micro-batch inside
        ``fabric.no_backward_sync``, a step per group): the gradient bytes this rank passed to reductions in
        backward and in step, and the weights before and after.
    compile (with --compile): three steps eager and three under torch.compile, handed over as train.py's --compile
        hands it: the wrapper the model ends in, whether the engine compiled the module, and whether the losses are
        the same.
    checkpoints: a model with frozen weights (as LoRA leaves the base model) trained two steps, saved as a step
        checkpoint and as a weights-only one as train.py saves ``checkpoints/best``.
        bytes: the size on disk of each checkpoint; trainable: the number of trained (not frozen) weights.
        export_keys / missing: the names ``deepspeed_engine.full_state_dict`` gathers from the weights-only checkpoint, and
            those of the model it lacks; export_matches: whether every gathered weight equals the trained one.
        reloaded_matches: whether loading the weights-only checkpoint into a fresh engine, as train.py's finish()
            does, gives back the trained weights.

    python tests/shims/zero_probe.py deepspeed_stage_2 OUT.json [--compile]
"""

import argparse
import collections
import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import deepspeed
import torch
import torch.nn.functional as F

from fabric_utils.checkpoint import load_weights, save_checkpoint
from fabric_utils.checkpoint_io import frozen_weights
from fabric_utils.deepspeed_engine import compile_in_engine, full_state_dict, prepare_for_setup
from fabric_utils.launcher import build_fabric, end_job
from fabric_utils.optim import build_optimizer
from fabric_utils.compiling import warm_up

STEPS, ROWS, FEATURES = 3, 8, 16
WIDTH = 128  # of the checkpointed model
REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_reduce_coalesced")


def bytes_reduced() -> int:
    """Bytes this rank has passed to reduction collectives, from DeepSpeed's own comms logger. One-number
    reductions (the gradient norm, the overflow check) carry no gradients and are left out."""
    return sum(size * record[0] for name, sizes in deepspeed.comm.comms_logger.comms_dict.items()
               if name in REDUCTIONS for size, record in sizes.items() if size > 8)


@contextlib.contextmanager
def counting(totals: collections.Counter, phase: str):
    before = bytes_reduced()
    yield
    totals[phase] += bytes_reduced() - before


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))

    def forward(self, x, labels):
        return SimpleNamespace(loss=F.cross_entropy(self.net(x), labels))


def rows(seed: int, n: int = ROWS) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, FEATURES, generator=generator), "labels": torch.randint(0, 2, (n,), generator=generator)}


def setup(fabric):
    """A fresh model and engine: the same starting weights each time."""
    fabric.seed_everything(0)
    model = Tiny()
    return fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))


def weights(model) -> list:
    """The fp32 master weights, gathered from the shards by DeepSpeed's own accessor."""
    return torch.cat([deepspeed.utils.safe_get_full_fp32_param(p).flatten() for p in model.parameters()]).tolist()


def accumulate(fabric) -> dict:
    report = {}
    for grad_accum in (1, 2, 4):
        model, optimizer = setup(fabric)
        reduced = collections.Counter()
        before = weights(model)
        for step in range(STEPS):
            batch = rows(seed=100 * step + fabric.global_rank)  # the same rows, whatever grad_accum
            for micro in range(grad_accum):
                chunk = {k: v.chunk(grad_accum)[micro] for k, v in batch.items()}
                with fabric.no_backward_sync(model, enabled=micro < grad_accum - 1), counting(reduced, "backward"):
                    fabric.backward(model(**chunk).loss / grad_accum, model=model)
            with counting(reduced, "step"):
                optimizer.step()
            optimizer.zero_grad()
        report[grad_accum] = {**reduced, "weights_before": before, "weights_after": weights(model)}
    return report


def warm_up_leak(fabric) -> dict:
    report = {}
    for warm in (True, False):  # warm_up's fabric.backward needs the engine to be the only one so far
        model, optimizer = setup(fabric)
        if warm:
            warm_up(fabric, model, optimizer, [rows(seed=7)], loss_fn=lambda module, batch: module(**batch).loss)
        fabric.backward(model(**rows(seed=fabric.global_rank)).loss, model=model)
        optimizer.step()
        optimizer.zero_grad()
        report["with_warm_up" if warm else "without"] = weights(model)
    return report


def compiled(fabric) -> dict:
    losses = {}
    for compiling in (False, True):
        fabric.seed_everything(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        if compiling:  # the eager backend keeps the probe quick
            model = torch.compile(model, backend="eager", dynamic=True)
        model, compile_kwargs = prepare_for_setup(fabric, model)
        model, optimizer = fabric.setup(model, build_optimizer(model, "adamw", lr=1e-2, weight_decay=0.0,
                                                               device=fabric.device))
        compile_in_engine(fabric, compile_kwargs)
        losses[compiling] = []
        for step in range(3):
            loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().mean()
            fabric.backward(loss, model=model)
            optimizer.step()
            optimizer.zero_grad()
            losses[compiling].append(loss.item())
    return {"wrapper": type(model._forward_module).__name__, "engine_compiled": fabric.strategy.model.is_compiled,
            "same_losses": losses[True] == losses[False]}


def build_frozen(fabric):
    """A fresh model whose first layer is frozen, set up as train.py sets one up."""
    fabric.seed_everything(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH),
                                torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1))
    model[0].requires_grad_(False)  # a frozen base, as under --lora-r
    model, _ = prepare_for_setup(fabric, model)
    return fabric.setup(model, build_optimizer(model, "adamw", lr=1e-2, weight_decay=0.01, device=fabric.device))


def full_weights(model) -> dict:
    """Every weight, whole (ZeRO-3 gathers its partitions; a no-op for stages 1 and 2). In 32-true the module's
    weights are the fp32 master weights."""
    with deepspeed.zero.GatheredParameters(list(model.module.parameters())):
        return {name: param.detach().cpu().clone() for name, param in model.module.named_parameters()}


def size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def checkpoints(fabric, root: Path) -> dict | None:
    """The report's ``checkpoints`` part, on rank 0 (None on the others)."""
    root = Path(fabric.broadcast(str(root)))
    model, optimizer = build_frozen(fabric)
    for step in range(2):
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(10 * step + fabric.global_rank))
        fabric.backward(model(x).square().mean(), model=model)
        optimizer.step()
        optimizer.zero_grad()
    trained = full_weights(model)
    save_checkpoint(fabric, root, "step-000002", {"model": model, "optimizer": optimizer, "step": 2})
    save_checkpoint(fabric, root, "best", {"model": model, "step": 2})

    fresh, _ = build_frozen(fabric)  # train.py's finish(): the best model into the live engine
    load_weights(fabric, root / "best" / "state", fresh)
    reloaded = full_weights(fresh)
    frozen = frozen_weights(fabric, fresh)  # what export_model adds to the checkpoint, which leaves them out
    if not fabric.is_global_zero:
        return None
    exported = {**frozen, **full_state_dict(root / "best" / "state")}
    return {"bytes": {tag: size(root / tag) for tag in ("step-000002", "best")},
            "trainable": sum(param.numel() for param in model.parameters() if param.requires_grad),
            "export_keys": sorted(exported), "missing": sorted(set(trained) - set(exported)),
            "export_matches": all(torch.equal(exported[name], weight)
                                  for name, weight in trained.items() if name in exported),
            "reloaded_matches": all(torch.equal(reloaded[name], weight) for name, weight in trained.items())}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy")
    parser.add_argument("out")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--compile", action="store_true")  # dynamo's tracing costs more than the rest of the probe
    args = parser.parse_args()
    fabric = build_fabric(accelerator="cpu", devices="2", strategy=args.strategy, precision=args.precision)
    fabric.launch()
    deepspeed.comm.configure(enabled=True, prof_all=True)
    # warm_up_leak first: its warm-up needs the engine to be the first one
    report = {"warm_up": warm_up_leak(fabric), "accumulate": accumulate(fabric),
              "checkpoints": checkpoints(fabric, Path(args.out).parent / "checkpoints")}
    if args.compile:
        report["compile"] = compiled(fabric)
    if fabric.is_global_zero:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    end_job(fabric)


if __name__ == "__main__":
    main()
