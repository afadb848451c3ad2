"""On SIGTERM / SIGUSR1 (SLURM's and Kubernetes' notice) and Ctrl-C: every rank checkpoints, then the job exits
``EXIT_PREEMPTED`` for a wrapper to requeue; a second Ctrl-C stops at once."""

import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only

from fabric_utils.launcher import end_job
from fabric_utils.private import _SubprocessScriptLauncher, stop_workers

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later"
GRACE_S = 120  # after a signal, the longest a run may go without a step before it ends (schedulers kill sooner)
STATUS_FILE = "preempted.txt"  # in --out-dir; scripts/slurm.sbatch reads it


class Preemption:
    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1, signal.SIGINT), grace_s: int = GRACE_S):
        self.requested, self.interrupted, self.training, self.grace_s = False, False, True, grace_s
        self._noted, self._pid = set(), os.getpid()
        if threading.current_thread() is not threading.main_thread():
            signals = ()  # Python takes handlers in the main thread only: the launcher's restarts cover it (Ray Train)
        self._previous = {sig: signal.signal(sig, self._handle) for sig in signals}
        self.group, self.vote = None, None  # the vote group; the vote in flight and its flag

    def _handle(self, signum, frame):
        if os.getpid() != self._pid:  # a loader worker, forked with this handler
            return
        if signum == signal.SIGINT:
            if self.interrupted:  # the second Ctrl-C: stop now, dying of SIGINT as a shell expects
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            self.interrupted = True
        if self.training and not self.requested:  # a run stuck between two steps still ends
            signal.signal(signal.SIGALRM, self._overdue)
            signal.alarm(self.grace_s)
        self.requested |= self.training
        if (signum, self.training) not in self._noted:
            self._noted.add((signum, self.training))
            note = ("stopping at the next check with a checkpoint, then exiting 75" if self.training
                    else "training has ended, so the run finishes")
            again = "; Ctrl-C again to stop at once" if signum == signal.SIGINT else ""
            rank = f"rank {rank_zero_only.rank}: " if rank_zero_only.rank else ""
            # os.write: a print() here could land inside another print() and fail
            os.write(2, f"{rank}{signal.Signals(signum).name}: {note}{again}\n".encode())

    def _overdue(self, signum, frame):
        os.write(2, f"no training step within {self.grace_s} s of the signal: ending without a checkpoint (the last "
                    f"one stays)\n".encode())
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def agreed(self, fabric) -> bool:
        """Whether all ranks stop now, one step after a signal reached any: an async gloo vote on a host flag, read a
        step later, never waits on the device."""
        stop = self._agreed(fabric)
        if self.requested:  # a step was taken: the grace starts again, or ends with the stop
            signal.alarm(0 if stop else self.grace_s)
        return stop

    def _agreed(self, fabric) -> bool:
        if fabric.world_size == 1:
            return self.requested
        if self.group is None:
            self.group = dist.new_group(backend="gloo")
        stop = False
        if self.vote is not None:
            self.vote[0].wait()
            stop = bool(self.vote[1].item())
        flag = torch.tensor([int(self.requested)])
        self.vote = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag
        return stop

    def training_ended(self) -> None:
        """From now on a signal cannot stop the run: it has nothing left to checkpoint."""
        self.training = False
        if self.requested:
            signal.alarm(0)

    def exit(self, fabric, loaders: dict, out_dir: Path, step: int, checkpoint: Path):
        """Rank 0 writes ``STATUS_FILE``, then every rank exits ``EXIT_PREEMPTED``; a child of Lightning's launcher
        waits for it to exit first, as it SIGKILLs itself when a child exits non-zero."""
        if fabric.is_global_zero:
            tmp = out_dir / f".tmp-{STATUS_FILE}"
            tmp.write_text(f"preempted at step {step}, checkpoint {checkpoint}\n")
            os.replace(tmp, out_dir / STATUS_FILE)
        self.close(fabric, loaders)
        strategy = fabric.strategy
        if (fabric.local_rank > 0 and isinstance(getattr(strategy, "launcher", None), _SubprocessScriptLauncher)
                and isinstance(getattr(strategy, "cluster_environment", None), LightningEnvironment)):
            parent = os.getppid()
            deadline = time.monotonic() + 30
            while os.getppid() == parent and time.monotonic() < deadline:
                time.sleep(0.05)
        raise SystemExit(EXIT_PREEMPTED)

    def close(self, fabric, loaders: dict, completed: Path | None = None) -> None:
        """Workers, barrier, process group, in this order, as teardown alone can abort in C++; then SIGTERM and
        SIGUSR1 are ignored (teardown would reset a handler to the fatal default)."""
        if completed is not None and fabric.is_global_zero:
            (completed / STATUS_FILE).unlink(missing_ok=True)
        for loader in loaders.values():
            stop_workers(loader)
        if self.vote is not None:
            self.vote[0].wait()
        end_job(fabric)
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if sig == signal.SIGINT else signal.SIG_IGN)
