"""Test-only script: trains a small model with frozen weights (as LoRA leaves the base model) for two steps under a
DeepSpeed strategy on 2 CPU processes (run it under the shim in sitecustomize.py), saves a step checkpoint and a
weights-only one as train.py saves ``checkpoints/best``, and writes what tests/test_deepspeed_checkpoints.py checks
as JSON to OUT:

    bytes: the size on disk of each checkpoint; trainable: the number of trained (not frozen) weights.
    export_keys / missing: the names ``export.full_state_dict`` gathers from the weights-only checkpoint, and those of
        the model it lacks; export_matches: whether every gathered weight equals the trained one.
    reloaded_matches: whether loading the weights-only checkpoint into a fresh engine, as train.py's finish() does,
        gives back the trained weights.

    python tests/shims/zero_checkpoint_probe.py deepspeed_stage_1 OUT.json
"""

import argparse
import json
from pathlib import Path

import deepspeed
import torch

from fabric_utils.checkpoint import load_weights, save_checkpoint
from fabric_utils.export import full_state_dict
from fabric_utils.launcher import build_fabric, end_job
from fabric_utils.optim import build_optimizer
from fabric_utils.sharding import prepare_for_setup

WIDTH = 128


def build(fabric):
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy")
    parser.add_argument("out")
    args = parser.parse_args()
    fabric = build_fabric(accelerator="cpu", devices="2", strategy=args.strategy, precision="32-true")
    fabric.launch()
    root = Path(fabric.broadcast(str(Path(args.out).parent / "checkpoints")))
    model, optimizer = build(fabric)
    for step in range(2):
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(10 * step + fabric.global_rank))
        fabric.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()
    trained = full_weights(model)
    save_checkpoint(fabric, root, "step-000002", {"model": model, "optimizer": optimizer, "step": 2})
    save_checkpoint(fabric, root, "best", {"model": model, "step": 2})

    fresh, _ = build(fabric)  # train.py's finish(): the best model into the live engine
    load_weights(fabric, root / "best" / "state", fresh)
    reloaded = full_weights(fresh)
    if fabric.is_global_zero:
        exported = full_state_dict(root / "best" / "state")
        report = {"bytes": {tag: size(root / tag) for tag in ("step-000002", "best")},
                  "trainable": sum(param.numel() for param in model.parameters() if param.requires_grad),
                  "export_keys": sorted(exported), "missing": sorted(set(trained) - set(exported)),
                  "export_matches": all(torch.equal(exported[name], weight)
                                        for name, weight in trained.items() if name in exported),
                  "reloaded_matches": all(torch.equal(reloaded[name], weight) for name, weight in trained.items())}
        Path(args.out).write_text(json.dumps(report, indent=1))
    end_job(fabric)


if __name__ == "__main__":
    main()
