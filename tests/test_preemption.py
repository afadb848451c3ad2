"""A preempted job leaves cleanly every time. Every rank stops its loader workers and destroys the process
group before it exits 75, so none can abort in C++ on the way out ("terminate called without an active exception",
which made srun report 134 and SLURM not requeue); a signal after the loop (test, export, teardown) does not fail a
finished run; Ctrl-C stops like a preemption, and a second one at once.

The jobs are tests/preemption_job.py: 2 ranks each, as srun starts them, forked from one process that imported torch
and Lightning once, so that 20 preemptions (40 ranks) take about half a minute of two cores."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, subprocess_env

EXIT_PREEMPTED = 75
PREEMPTIONS = 20


class Jobs:
    """``tests/preemption_job.py ROOT --jobs N ...`` in the background."""

    def __init__(self, root: Path, jobs: int, *flags: str):
        self.root, self.jobs = root, jobs
        self.log = root / "launcher.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "tests/preemption_job.py", str(root), "--jobs", str(jobs),
                                          *flags], cwd=REPO, env=subprocess_env(), stdout=log,
                                         stderr=subprocess.STDOUT)

    def pgid(self, j: int) -> int:
        return int((self.root / f"job-{j}" / "pgid").read_text())

    def signal_when(self, name: str, signals: list, timeout=300) -> None:
        """Sends ``signals[j]`` to every process of job ``j`` as soon as it has written ``name``."""
        deadline, waiting = time.monotonic() + timeout, dict(enumerate(signals))
        while waiting:
            for j in [j for j in waiting if (self.root / f"job-{j}" / name).exists()]:
                os.killpg(self.pgid(j), waiting.pop(j))
            assert self.proc.poll() is None, f"the jobs ended before {name} appeared in {sorted(waiting)}"
            assert time.monotonic() < deadline, f"no {name} within {timeout} s in jobs {sorted(waiting)}"
            time.sleep(0.01)

    def statuses(self, timeout=300) -> dict:
        """Each job's exit status per rank, once all have ended."""
        assert self.proc.wait(timeout) == 0, self.log.read_text()[-3000:]
        return {int(j): ranks for j, ranks in json.loads((self.root / "statuses.json").read_text()).items()}

    def output(self, j: int) -> str:
        return "".join(f"--- rank {r}\n{path.read_text()[-3000:]}"
                       for r, path in enumerate(sorted((self.root / f"job-{j}").glob("rank*.log"))))


def test_every_rank_exits_75_on_every_preemption(tmp_path):
    """20 jobs of 2 ranks get SIGUSR1 after their first checkpoint, in every process (as SLURM sends it); two more get
    SIGTERM and Ctrl-C."""
    signals = [signal.SIGUSR1] * PREEMPTIONS + [signal.SIGTERM, signal.SIGINT]
    jobs = Jobs(tmp_path, len(signals))
    jobs.signal_when("checkpoints/step-000001", signals)
    statuses = jobs.statuses()
    failed = {j: ranks for j, ranks in statuses.items() if ranks != [EXIT_PREEMPTED] * 2}
    assert not failed, f"exit statuses {failed}\n{jobs.output(next(iter(failed)))}"
    for j in range(len(signals)):
        assert "terminate called" not in jobs.output(j), jobs.output(j)
        status = (tmp_path / f"job-{j}" / "preempted.txt").read_text()
        found = re.fullmatch(r"preempted at step (\d+), checkpoint (\S+)\n", status)
        assert found and Path(found.group(2)).name == f"step-{int(found.group(1)):06d}", status
        assert (Path(found.group(2)) / "rng-rank1.pt").is_file(), status


def test_signals_after_the_loop_do_not_fail_a_finished_run(tmp_path):
    """One Ctrl-C once the loop has ended, then SIGUSR1 and SIGTERM over and over until every process of the job has
    exited, so some land in the test and export, some in the shutdown and some in interpreter teardown (where Python
    puts back the fatal default handlers)."""
    jobs = Jobs(tmp_path, 1, "--steps", "5", "--finish-s", "1")
    jobs.signal_when("finishing", [signal.SIGINT])
    pgid = jobs.pgid(0)
    try:
        while True:
            os.killpg(pgid, signal.SIGUSR1)
            os.killpg(pgid, signal.SIGTERM)
            time.sleep(0.002)
    except ProcessLookupError:  # the whole job has exited
        pass
    assert jobs.statuses() == {0: [0, 0]}, jobs.output(0)
    assert "SIGINT: training has ended, so the run finishes; Ctrl-C again to stop at once" in jobs.output(0)


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    jobs = Jobs(tmp_path, 1, "--steps", "5", "--finish-s", "300")
    jobs.signal_when("finishing", [signal.SIGINT])
    deadline = time.monotonic() + 30
    while "SIGINT: training has ended" not in jobs.output(0):
        assert time.monotonic() < deadline, jobs.output(0)
        time.sleep(0.05)
    time.sleep(1)  # rank 1 handles it too (it prints nothing); two signals before a handler runs count once
    os.killpg(jobs.pgid(0), signal.SIGINT)
    assert jobs.statuses(timeout=30) == {0: [-signal.SIGINT] * 2}, jobs.output(0)


def test_sigterm_ends_a_run_stuck_between_steps():
    """A loop that never reaches its next step (a planted record once made one) still ends after SIGTERM: once its
    grace has passed without a step, as killed by the signal, saying so."""
    script = ("from fabric_utils.preemption import Preemption\nPreemption(grace_s=2)\nprint('ready', flush=True)\n"
              "while True:\n    pass\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n", proc.communicate(timeout=60)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM and 2 <= time.monotonic() - start < 30, stderr[-3000:]
    assert stderr.splitlines() == ["SIGTERM: stopping at the next check with a checkpoint, then exiting 75",
                                   "no training step within 2 s of the signal: ending without a checkpoint (the last "
                                   "one stays)"]
