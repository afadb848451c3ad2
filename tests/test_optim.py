"""The learning-rate schedules are transformers' (fabric_utils must not import it, so they are written on torch's
LambdaLR); checked step by step against transformers' own."""

import pytest
import torch
from transformers import get_scheduler

from fabric_utils.optim import build_scheduler


@pytest.mark.parametrize("name, theirs", [("linear", "linear"), ("cosine", "cosine"),
                                          ("constant", "constant_with_warmup")])
@pytest.mark.parametrize("warmup", [0, 7])
def test_schedules_match_transformers(name, theirs, warmup):
    ours = build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0), name, lr=2.0,
                           max_steps=50, warmup_steps=warmup)
    reference = get_scheduler(theirs, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0),
                              num_warmup_steps=warmup, num_training_steps=50)
    for _ in range(55):
        assert ours.get_last_lr() == pytest.approx(reference.get_last_lr(), abs=1e-12)
        ours.optimizer.step()
        reference.optimizer.step()
        ours.step()
        reference.step()
