"""Stop cleanly on SIGTERM / SIGUSR1 (what SLURM and Kubernetes send before killing a job) and on Ctrl-C: the loop
finishes its step, every rank saves a checkpoint, and the job exits with ``EXIT_PREEMPTED`` so a wrapper can requeue
it. A second Ctrl-C stops at once. A signal that comes once the loop has ended is noted and the run finishes.

Both ways out (``Preemption.exit`` and ``Preemption.close``) end every rank in the same order: the loaders' worker
processes stopped, a barrier (no collective left in flight), the process group destroyed, then the exit. Left to
interpreter teardown, they can kill a rank in C++ (``terminate called without an active exception``), which turns
status 75 into 134 and a requeue into a failed job."""

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only

from fabric_utils.launcher import end_job
from fabric_utils.private import _SubprocessScriptLauncher, stop_workers

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later"
STATUS_FILE = "preempted.txt"  # in --out-dir; scripts/requeue.sh reads it
LAUNCHER_EXIT_WAIT_S = 30.0


class Preemption:
    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)):
        self.requested = False
        self.training = True
        self.interrupted = False
        self._noted = set()
        self._pid = os.getpid()
        self._previous = {sig: signal.signal(sig, self._handle) for sig in signals}
        self.group, self.vote = None, None  # the processes' vote group; the vote in flight and its flag

    def _handle(self, signum, frame):
        if os.getpid() != self._pid:  # a loader worker (forked with this handler): its process decides
            return
        if signum == signal.SIGINT:
            if self.interrupted:  # the second Ctrl-C: stop now, dying of SIGINT as a shell expects
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            self.interrupted = True
        if self.training:
            self.requested = True
            note = "stopping at the next check with a checkpoint, then exiting 75"
        else:
            note = "training has ended, so the run finishes"
        if (signum, self.training) not in self._noted:  # once, not per signal; by each rank it reached (maybe one)
            self._noted.add((signum, self.training))
            again = "; Ctrl-C again to stop at once" if signum == signal.SIGINT else ""
            rank = f"rank {rank_zero_only.rank}: " if rank_zero_only.rank else ""
            # os.write: a print() here could land inside another print() and fail
            os.write(2, f"{rank}{signal.Signals(signum).name}: {note}{again}\n".encode())

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

    def training_ended(self) -> None:
        """From now on (test, export, teardown) a signal cannot stop the run: it has nothing left to checkpoint."""
        self.training = False

    def exit(self, fabric, loaders: dict, out_dir: Path, step: int, checkpoint: Path):
        """Exits with ``EXIT_PREEMPTED`` once ``checkpoint`` is saved on every rank (and the loggers flushed).

        Rank 0 first writes ``out_dir/STATUS_FILE``, so a wrapper knows the checkpoint was written even if a rank
        then fails on the way out. When Lightning's own launcher started this process (``train.py --devices N``:
        rank 0 starts local ranks 1..N-1), that launcher SIGKILLs itself as soon as it sees a child exit with a
        non-zero status while it still runs, which would turn its own status 75 into -9. So a started rank lets the
        launcher exit first (it becomes an orphan: its parent changes), waiting at most LAUNCHER_EXIT_WAIT_S."""
        if fabric.is_global_zero:
            write_atomically(out_dir / STATUS_FILE, f"preempted at step {step}, checkpoint {checkpoint}\n")
        self.close(fabric, loaders)
        if _started_by_lightning_launcher(fabric):
            parent = os.getppid()
            deadline = time.monotonic() + LAUNCHER_EXIT_WAIT_S
            while os.getppid() == parent and time.monotonic() < deadline:
                time.sleep(0.05)
        raise SystemExit(EXIT_PREEMPTED)

    def close(self, fabric, loaders: dict) -> None:
        """Ends this rank's part of the job: workers, barrier, process group. SIGTERM and SIGUSR1 are ignored from
        here on (a Python handler would be reset to the default, fatal one during interpreter teardown); Ctrl-C goes
        back to whoever handled it before."""
        for loader in loaders.values():
            stop_workers(loader)
        if self.vote is not None:  # the last vote, still in flight on the vote group
            self.vote[0].wait()
        end_job(fabric)
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if sig == signal.SIGINT else signal.SIG_IGN)


def ignore_sigterm_in_worker(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``. SLURM signals every process of a job step, loader workers included, and
    PyTorch's workers die of a SIGTERM that does not come from their own process: the rank would then fail with
    "DataLoader worker exited unexpectedly" instead of saving its checkpoint. The rank stops its workers itself."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader sees the whole file or none


def _started_by_lightning_launcher(fabric) -> bool:
    from lightning.fabric.plugins.environments import LightningEnvironment

    strategy = fabric.strategy
    return (fabric.local_rank > 0 and isinstance(getattr(strategy, "launcher", None), _SubprocessScriptLauncher)
            and isinstance(getattr(strategy, "cluster_environment", None), LightningEnvironment))
