"""Stop cleanly on SIGTERM / SIGUSR1 (what SLURM and Kubernetes send before killing a job): the loop finishes its
step, every rank saves a checkpoint, and the job exits with ``EXIT_PREEMPTED`` so a wrapper can requeue it."""

import os
import signal
import time

import torch

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later"
LAUNCHER_EXIT_WAIT_S = 30.0
# how often ranks vote on stopping: SLURM's USR1@90 leaves 90 s for the rest of the step, the vote and the checkpoint
VOTE_EVERY_S = 5.0


class Preemption:
    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1), vote_every_s: float = VOTE_EVERY_S):
        self.requested = False
        self.vote_every_s = vote_every_s
        self.next_vote, self.last_vote = 1, None  # the step of the next vote; (step, time) of the last
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def agreed(self, fabric, step: int) -> bool:
        """Whether all ranks stop after ``step``. A signal may reach only some ranks (``kill`` of the launcher
        process), so ranks vote through an all-reduce. It syncs the device, so it runs about every ``vote_every_s``
        seconds, at every step when steps take longer. Each rank proposes when to vote next, as many steps as fit in
        that time at the pace since the last vote; the vote takes the earliest, so every rank votes at the same
        steps."""
        if fabric.world_size == 1:
            return self.requested
        if step < self.next_vote:
            return False
        now = time.monotonic()
        steps_apart = 1
        if self.last_vote is not None:
            last_step, last_time = self.last_vote
            steps_apart = max(1, int(self.vote_every_s * (step - last_step) / max(now - last_time, 1e-6)))
        stop, earliest = fabric.all_reduce(torch.tensor([float(self.requested), -float(steps_apart)]),
                                           reduce_op="max").tolist()
        self.next_vote, self.last_vote = step + int(-earliest), (step, now)
        return stop > 0

    def exit(self, fabric):
        """Exits with ``EXIT_PREEMPTED`` once the checkpoint is saved on every rank.

        When Lightning's own launcher started this process (``train.py --devices N``: rank 0 starts local ranks
        1..N-1), that launcher SIGKILLs itself as soon as it sees a child exit with a non-zero status while it still
        runs, which would turn its own status 75 into -9. So a started rank lets the launcher exit first (it
        becomes an orphan: its parent changes), waiting at most LAUNCHER_EXIT_WAIT_S."""
        if _started_by_lightning_launcher(fabric):
            parent = os.getppid()
            deadline = time.monotonic() + LAUNCHER_EXIT_WAIT_S
            while os.getppid() == parent and time.monotonic() < deadline:
                time.sleep(0.05)
        raise SystemExit(EXIT_PREEMPTED)


def _started_by_lightning_launcher(fabric) -> bool:
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    strategy = fabric.strategy
    return (fabric.local_rank > 0 and isinstance(getattr(strategy, "launcher", None), _SubprocessScriptLauncher)
            and isinstance(getattr(strategy, "cluster_environment", None), LightningEnvironment))
