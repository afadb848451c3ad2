"""When the ranks agree to stop after a signal: one step after it reached any of them, all at the same step, with
no device sync (the vote is a host tensor over gloo, read a step after it was sent)."""

import os
import signal
from types import SimpleNamespace

import torch.distributed as dist
import torch.multiprocessing as mp

from fabric_utils.preemption import Preemption


def _steps_on_rank(rank: int, port: int, stopped):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    vote, fabric = Preemption(signals=()), SimpleNamespace(world_size=2)
    for step in range(1, 20):
        if rank == 1 and step == 7:  # a signal that reached rank 1 only, during step 7
            vote._handle(signal.SIGTERM, None)
        if vote.agreed(fabric):
            stopped[rank] = step
            break
    dist.destroy_process_group()


def test_every_rank_stops_one_step_after_a_signal_reached_one():
    """The vote used to run every --log-every steps (10 by default): with multi-second steps, minutes after
    SLURM's warning, which leaves 90 s for the step, the vote and the checkpoint."""
    stopped = mp.Manager().dict()
    mp.start_processes(_steps_on_rank, args=(29800 + os.getpid() % 1000, stopped), nprocs=2, start_method="spawn")
    assert dict(stopped) == {0: 8, 1: 8}


def test_one_process_stops_at_once():
    vote = Preemption(signals=())
    fabric = SimpleNamespace(world_size=1)
    assert not vote.agreed(fabric)
    vote._handle(signal.SIGTERM, None)
    assert vote.agreed(fabric)
