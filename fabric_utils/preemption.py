"""Stop cleanly on SIGTERM / SIGUSR1 (what SLURM and Kubernetes send before killing a job): the loop finishes its
step, every rank saves a checkpoint, and the job exits with ``EXIT_PREEMPTED`` so a wrapper can requeue it."""

import os
import signal
import time

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later"
LAUNCHER_EXIT_WAIT_S = 30.0


class Preemption:
    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1)):
        self.requested = False
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def agreed(self, fabric, check_now: bool) -> bool:
        """Whether all ranks stop now. A signal may reach only some ranks (``kill`` of the launcher process), so
        ranks agree through an all-reduce, done only every ``check_now`` step since it syncs the device."""
        if fabric.world_size == 1:
            return self.requested
        return check_now and fabric.strategy.reduce_boolean_decision(self.requested, all=False)

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
