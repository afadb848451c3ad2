"""Test-only script: trains a tiny model through ``build_fabric`` with a DeepSpeed strategy on 2 CPU processes
(run it under the shim in sitecustomize.py) and writes what tests/test_deepspeed.py checks as JSON to OUT:

    warm_up: one step, with and without ``speed.warm_up`` before it: the weights after it.
    accumulate: for --grad-accum 1, 2 and 4 over the same rows, train.py's loop (backward per micro-batch inside
        ``fabric.no_backward_sync``, a step per group): the gradient bytes this rank passed to reductions in
        backward and in step, and the weights before and after.

    python tests/shims/zero_probe.py deepspeed_stage_2 OUT.json
"""

import argparse
import collections
import contextlib
import json
from types import SimpleNamespace

import deepspeed
import torch
import torch.nn.functional as F

from fabric_utils.launcher import build_fabric, end_job
from fabric_utils.speed import warm_up

STEPS, ROWS, FEATURES = 3, 8, 16
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy")
    parser.add_argument("out")
    parser.add_argument("--precision", default="32-true")
    args = parser.parse_args()
    fabric = build_fabric(accelerator="cpu", devices="2", strategy=args.strategy, precision=args.precision)
    fabric.launch()
    deepspeed.comm.configure(enabled=True, prof_all=True)
    report = {"warm_up": warm_up_leak(fabric), "accumulate": accumulate(fabric)}
    if fabric.is_global_zero:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    end_job(fabric)


if __name__ == "__main__":
    main()
