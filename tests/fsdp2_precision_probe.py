"""Test-only script: trains a small model under ``--strategy fsdp2`` on 2 CPU processes in the given precision
through build_fabric and train.py's set-up steps, and writes what tests/test_sharded_training.py checks as JSON
to OUT:

    gathered / reduced: for the last step, the bytes this rank received from FSDP2's all-gathers (weights) and
        passed to its reduce-scatters (gradients), by dtype.
    params: the model's weight count; losses: the loss of each step; reference_losses: the same steps in one
        process under the same autocast, on both ranks' rows (what data parallelism must reproduce).

    python tests/fsdp2_precision_probe.py bf16-mixed OUT.json
"""

import argparse
import collections
import copy
import inspect
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fabric_utils.launcher import build_fabric, end_job  # noqa: E402
from fabric_utils.optim import build_optimizer  # noqa: E402
from fabric_utils.sharding import cast_shards, prepare_for_setup  # noqa: E402

STEPS, ROWS, WIDTH = 3, 8, 64


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.linear = torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.linear(self.norm(x)).tanh()


class Net(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).float().square().mean()


def counting(name: str, counts: dict, argument: str):
    """Wraps ``torch.distributed.<name>`` (FSDP2 looks it up at call time) to add up the bytes of one of its tensor
    arguments by dtype."""
    original = getattr(dist, name)
    signature = inspect.signature(original)

    def wrapper(*args, **kwargs):
        tensor = signature.bind(*args, **kwargs).arguments[argument]
        counts[str(tensor.dtype)] += tensor.numel() * tensor.element_size()
        return original(*args, **kwargs)
    setattr(dist, name, wrapper)


def rows(step: int, rank: int) -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("precision")
    parser.add_argument("out")
    args = parser.parse_args()
    fabric = build_fabric(accelerator="cpu", devices="2", strategy="fsdp2", precision=args.precision)
    fabric.launch()
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    make = lambda module: build_optimizer(module, "adamw", lr=1e-3, weight_decay=0.01,  # noqa: E731
                                          device=fabric.device)
    model = cast_shards(fabric, fabric.setup_module(prepare_for_setup(fabric, model)[0]))
    optimizer = fabric.setup_optimizers(make(model))
    reference_optimizer = make(reference)
    gathered, reduced = collections.Counter(), collections.Counter()
    losses, reference_losses = [], []
    for step in range(STEPS):
        if step == STEPS - 1:
            counting("all_gather_single", gathered, argument="output_tensor")
            counting("reduce_scatter_single", reduced, argument="input")
        loss = model(rows(step, fabric.global_rank))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        with fabric.autocast():  # the same autocast, in one process, on both ranks' rows
            reference_loss = reference(torch.cat([rows(step, rank) for rank in range(2)]))
        reference_loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        reference_losses.append(reference_loss.item())
    if fabric.is_global_zero:
        Path(args.out).write_text(json.dumps({
            "gathered": gathered, "reduced": reduced, "params": sum(p.numel() for p in reference.parameters()),
            "losses": losses, "reference_losses": reference_losses}, indent=1))
    end_job(fabric)


if __name__ == "__main__":
    main()
