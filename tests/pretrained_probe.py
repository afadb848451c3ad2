"""Test-only script: ``PROBE_OUT=DIR python tests/pretrained_probe.py [train.py flags]`` runs train.py with these flags
and writes what tests/test_pretrained.py checks to DIR/rank-<R>.json, as each rank saw it:

    share: the share of the model's parameter elements this rank holds when the model reaches Fabric's set-up
    (meta and ZeRO-3's partitions count what they hold: nothing, their partition)
    sources: how many times this rank built the pretrained model (``TaskSpec.build_model``)
    position_ids: whether every ``position_ids`` buffer of the set-up model is 0, 1, 2, ...
    logits: the set-up model's and, on the rank that built it, the pretrained model's, on the same fixed batch
    (evaluation mode); rank 0 also saves the pretrained model's weights, as the export writes them, to
    DIR/pretrained.pt.

With PROBE_LR0=1 the run trains at learning rate 0 (below --lr's range).
"""

import copy
import json
import os
from pathlib import Path

import torch

import train

OUT = Path(os.environ["PROBE_OUT"])  # not an argument: Lightning starts the other ranks with this argv
found = {"sources": 0}


def rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def held(param) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole parameter)."""
    if hasattr(param, "ds_numel"):
        return param.ds_tensor.numel(), param.ds_numel
    return (0 if param.is_meta else param.numel()), param.numel()


def logits_of(job, model, device) -> list:
    batch = job.collate([job.datasets["validation"][i] for i in range(4)])
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = job.objective.forward(model, {name: value.to(device) for name, value in batch.items()})
    model.train(was_training)
    return logits.float().tolist()


def exported(model) -> dict:
    """The weights as the export writes them: LoRA merged into the weights it adapts."""
    model = copy.deepcopy(model).float()
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    return model.state_dict()


task_setup = train.task.setup


def probed_setup(args, verbose):
    job = task_setup(args, verbose)
    build = job.build_model

    def build_model():
        model = build()
        found["sources"] += 1
        found["source_logits"] = logits_of(job, copy.deepcopy(model).float(), "cpu")
        if rank() == 0:
            torch.save(exported(model), OUT / "pretrained.pt")
        return model

    job.build_model = build_model
    found["job"] = job
    return job


prepare_for_setup = train.sharding.prepare_for_setup


def probed_prepare_for_setup(fabric, model):
    counts = [held(param) for param in model.parameters()]
    found["share"] = sum(mine for mine, _ in counts) / sum(whole for _, whole in counts)
    return prepare_for_setup(fabric, model)


fit = train.fit


def probed_fit(fabric, args, state, **kwargs):
    model = state.model
    found["logits"] = logits_of(found["job"], model, fabric.device)
    found["position_ids"] = all(torch.equal(buffer.cpu(), torch.arange(buffer.shape[-1]).expand_as(buffer.cpu()))
                                for name, buffer in model.named_buffers() if name.endswith("position_ids"))
    if os.environ.get("PROBE_LR0") == "1":
        for group in state.optimizer.param_groups:
            group["lr"] = 0.0
        state.scheduler.base_lrs = [0.0] * len(state.scheduler.base_lrs)
    return fit(fabric, args, state, **kwargs)


train.task.setup = probed_setup
train.sharding.prepare_for_setup = probed_prepare_for_setup
train.fit = probed_fit

if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    train.setup()
    (OUT / f"rank-{rank()}.json").write_text(json.dumps({k: v for k, v in found.items() if k != "job"}))
