"""Stop cleanly on SIGTERM / SIGUSR1 (what SLURM and Kubernetes send before killing a job): the loop finishes its
step, every rank saves a checkpoint, and the job exits with ``EXIT_PREEMPTED`` so a wrapper can requeue it."""

import os
import signal
import time

import torch
import torch.distributed as dist

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later"
LAUNCHER_EXIT_WAIT_S = 30.0


class Preemption:
    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1)):
        self.requested = False
        self.group, self.vote = None, None  # the processes' vote group; the vote in flight and its flag
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def agreed(self, fabric) -> bool:
        """Whether all ranks stop now, one step after a signal reached any of them. A signal may reach only some
        ranks (``kill`` of the launcher process), so ranks vote every step with an all-reduce of a host tensor
        over gloo, started without waiting and read a step later: it never waits on the device, and by then it
        has long arrived. Every rank reads the same vote at the same step, so all stop together."""
        if fabric.world_size == 1:
            return self.requested
        if self.group is None:  # every rank gets here at its first step
            self.group = dist.new_group(backend="gloo")
        stop = False
        if self.vote is not None:
            work, flag = self.vote
            work.wait()
            stop = bool(flag.item())
        flag = torch.tensor([int(self.requested)])
        self.vote = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag
        return stop

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
