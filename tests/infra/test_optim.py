"""The learning-rate schedules are transformers' (train.py must not import it, so they are written on torch's
LambdaLR); checked step by step against transformers' own. AdamW runs torch's fused kernel on a CPU too."""

import pytest
import torch
from transformers import get_scheduler

from fabric_utils.optim import build_optimizer
from train import build_scheduler


@pytest.mark.parametrize("name, theirs, min_lr_rate", [("linear", "linear", 0.0), ("cosine", "cosine", 0.0),
                                                       ("constant", "constant_with_warmup", 0.0),
                                                       ("cosine", "cosine_with_min_lr", 0.3),
                                                       ("linear", "polynomial", 0.3)])
@pytest.mark.parametrize("warmup", [0, 7])
def test_schedules_match_transformers(name, theirs, min_lr_rate, warmup):
    ours = build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0), name, lr=2.0,
                           max_steps=50, warmup=warmup, min_lr_rate=min_lr_rate)
    reference = get_scheduler(theirs, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0),
                              num_warmup_steps=warmup, num_training_steps=50,
                              scheduler_specific_kwargs={"cosine_with_min_lr": {"min_lr_rate": min_lr_rate},
                                                         "polynomial": {"lr_end": 2.0 * min_lr_rate}}.get(theirs))
    for _ in range(55):
        assert ours.get_last_lr() == pytest.approx(reference.get_last_lr(), abs=1e-12)
        ours.optimizer.step()
        reference.optimizer.step()
        ours.step()
        reference.step()


def test_adamw_is_fused_on_a_cpu_and_updates_as_the_reference_does():
    """The fused kernel is about 10x faster than foreach on a CPU (bench/optimizer_step.py); it must make the same
    update."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))
    reference_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))
    reference_model.load_state_dict(model.state_dict())
    ours = build_optimizer(model, "adamw", lr=1e-2, weight_decay=0.1, device=torch.device("cpu"))
    assert all(group["fused"] for group in ours.param_groups)
    # 16-mixed: Fabric's loss scaler unscales before clipping, which fused kernels refuse (test_precision.py runs it)
    scaled = build_optimizer(model, "adamw", lr=1e-2, weight_decay=0.1, device=torch.device("cpu"), loss_scaling=True)
    assert not any(group["fused"] for group in scaled.param_groups)
    reference = torch.optim.AdamW([{"params": [p for p in reference_model.parameters() if p.ndim >= 2],
                                    "weight_decay": 0.1},
                                   {"params": [p for p in reference_model.parameters() if p.ndim < 2],
                                    "weight_decay": 0.0}], lr=1e-2, foreach=False)
    for _ in range(3):
        x = torch.randn(4, 8)
        for net, optimizer in ((model, ours), (reference_model, reference)):
            net(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for mine, theirs in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
