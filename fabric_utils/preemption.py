"""Stop cleanly on SIGTERM / SIGUSR1 (what SLURM and Kubernetes send before killing a job): the loop finishes its
step, every rank saves a checkpoint, and the job exits with ``EXIT_PREEMPTED`` so a wrapper can requeue it."""

import signal

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later"


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
