"""When the ranks vote on stopping after a signal: often enough that the checkpoint starts soon after it, rarely
enough that the vote (a host-device sync) does not slow fast steps."""

import signal
from types import SimpleNamespace

import pytest

from fabric_utils import preemption
from fabric_utils.preemption import Preemption


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def votes_until_stop(monkeypatch, step_seconds: float, signal_at: int, steps: int = 2000):
    """Steps of ``step_seconds`` on 2 ranks, a signal to this one during step ``signal_at``: the steps at which it
    voted, and the step after which the job stopped."""
    clock = Clock()
    monkeypatch.setattr(preemption.time, "monotonic", clock)
    voted = []

    def all_reduce(tensor, reduce_op):
        assert reduce_op == "max"
        voted.append(step)
        return tensor  # the other rank proposes the same, and got no signal
    fabric = SimpleNamespace(world_size=2, all_reduce=all_reduce)
    vote = Preemption(signals=())
    for step in range(1, steps + 1):
        clock.now += step_seconds
        if step == signal_at:
            vote._handle(signal.SIGTERM, None)
        if vote.agreed(fabric, step):
            return voted, step
    return voted, None


@pytest.mark.parametrize("step_seconds", [2.0, 30.0])
def test_slow_steps_vote_every_step_so_the_checkpoint_starts_right_after_the_signal(monkeypatch, step_seconds):
    """It used to vote every --log-every steps (10 by default): minutes of steps after SLURM's 90 s warning."""
    voted, stopped = votes_until_stop(monkeypatch, step_seconds, signal_at=37)
    assert stopped - 37 <= preemption.VOTE_EVERY_S / step_seconds + 1


def test_fast_steps_vote_about_every_few_seconds_not_every_step(monkeypatch):
    voted, stopped = votes_until_stop(monkeypatch, step_seconds=0.01, signal_at=700)
    apart = [later - earlier for earlier, later in zip(voted[1:], voted[2:])]  # from the first paced vote on
    assert apart and all(abs(steps - preemption.VOTE_EVERY_S / 0.01) <= 1 for steps in apart), voted
    assert 700 < stopped <= 700 + preemption.VOTE_EVERY_S / 0.01 + 1


def test_one_process_stops_at_once_without_a_vote():
    vote = Preemption(signals=())
    fabric = SimpleNamespace(world_size=1, all_reduce=None)
    assert not vote.agreed(fabric, 1)
    vote._handle(signal.SIGTERM, None)
    assert vote.agreed(fabric, 2)
