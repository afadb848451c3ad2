"""scripts/slurm.sbatch: its requeue decision, and the script itself on a real two-node SLURM on emulated nodes
(tests/cluster.py): a job preempted with ``scancel --signal=USR1`` is requeued, resumes and ends with the metrics of
the same world size on one node. Skipped where SLURM is not installed (CI installs it) or namespaces cannot be made."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import Cluster, Slurm
from conftest import REPO, Job, resumed_step, subprocess_env
from fabric_utils.preemption import STATUS_FILE
from test_resilience import COMPARED, TINY


@pytest.mark.parametrize("status, status_file, requeue", [
    (75, False, True),  # every task saved the checkpoint and stopped
    (134, True, True),  # the checkpoint was saved, then a task aborted on its way out
    (138, True, True),
    (134, False, False),  # a crash with nothing saved for it: repeating it would crash again
    (1, False, False),
    (0, False, False),  # finished
    (0, True, False),
])
def test_requeue_decision(tmp_path, status, status_file, requeue):
    """scripts/slurm.sbatch itself, with srun standing in for the run (its status, and preempted.txt if it saved a
    checkpoint) and scontrol recording a requeue."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    saved = f'echo "preempted at step 80" > "$OUT_DIR/{STATUS_FILE}"\n' if status_file else ""
    (bin_dir / "srun").write_text(f"#!/bin/sh\n{saved}exit {status}\n")
    (bin_dir / "scontrol").write_text('#!/bin/sh\necho "$@" > "$OUT_DIR/scontrol.txt"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    out = tmp_path / "run"
    out.mkdir()
    (out / STATUS_FILE).write_text("an earlier run's\n")  # only this run's preemption may requeue it
    env = {**subprocess_env(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT_DIR": str(out), "SLURM_JOB_ID": "7",
           "SLURM_CPUS_PER_TASK": "8"}
    done = subprocess.run(["bash", "scripts/slurm.sbatch"], cwd=REPO, env=env)
    assert done.returncode == status
    requeued = out / "scontrol.txt"
    assert (requeued.read_text() if requeued.exists() else None) == ("requeue 7\n" if requeue else None)


@pytest.fixture(scope="module")
def slurm(cluster):
    """A two-node SLURM on the emulated nodes."""
    slurm = Slurm(cluster, subprocess_env())
    yield slurm
    slurm.close()


def job_field(slurm: Slurm, job: str, field: str) -> str:
    return re.search(rf"\b{field}=(\S+)", slurm.command("scontrol", "show", "job", job)).group(1)


def wait_for_job(slurm: Slurm, job: str, until, log, timeout=300) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        state = job_field(slurm, job, "JobState")
        assert state not in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), log.read_text() + slurm.logs()
        assert time.monotonic() < deadline, f"job {job}: {state}\n{log.read_text()}"
        time.sleep(0.2)


def test_a_preempted_two_node_slurm_job_is_requeued_and_finishes_like_one_node(slurm, cluster, tmp_path):
    """sbatch scripts/slurm.sbatch on two nodes, one task each, from cold node-local caches: preempted with
    ``scancel --signal=USR1``, requeued, resumed, and ending with the metrics of the same world size on one node."""
    # the script's own --devices 4 --strategy deepspeed_stage_2 are overridden by these flags, which come after them
    flags = [*TINY, "--devices", "1", "--strategy", "ddp"]  # 50 steps, a checkpoint every 10
    out, log = tmp_path / "slurm-run", tmp_path / "slurm.out"
    for node in range(2):
        shutil.rmtree(cluster.home(node) / ".cache", ignore_errors=True)
    uninterrupted = Job(tmp_path / "uninterrupted", *flags, "--devices", "2")  # beside it, on one node
    slurm.env.update(OUT_DIR=str(out), PYTHON=sys.executable)
    job = slurm.command("sbatch", "--parsable", f"--chdir={REPO}", "--nodes=2", "--ntasks-per-node=1",
                        "--gpus-per-node=0", "--cpus-per-task=1", f"--output={log}", "scripts/slurm.sbatch",
                        *flags).strip()

    wait_for_job(slurm, job, lambda: list((out / "checkpoints").glob("step-*")), log)
    slurm.command("scancel", "--signal=USR1", job)
    wait_for_job(slurm, job, lambda: job_field(slurm, job, "Restarts") == "1"
                 and job_field(slurm, job, "JobState") == "PENDING", log)
    stopped = re.search(r"preempted: saved a checkpoint at step (\d+)", log.read_text())
    assert stopped, log.read_text()
    # else SLURM holds a requeue 2 min. Not "now": slurmd refuses a job whose credential is from the same second as
    # the last run's kill ("Job 1 already killed, do not launch batch job"), and the requeued job ends FAILED
    slurm.command("scontrol", "update", f"JobId={job}", "StartTime=now+2")
    wait_for_job(slurm, job, lambda: job_field(slurm, job, "JobState") == "COMPLETED", log)

    output = log.read_text()
    assert resumed_step(output) == int(stopped.group(1)), output
    assert "Traceback" not in output and "terminate called" not in output, output
    results, full = json.loads((out / "results.json").read_text()), uninterrupted.results()
    assert results["world_size"] == 2 and results["environment"]["num_nodes"] == 2, results
    assert results["steps"] == full["steps"] == 50
    for key in COMPARED:
        assert results[key] == pytest.approx(full[key], abs=1e-4), key
    assert sorted(p.name for p in out.parent.iterdir()) == ["slurm-run", "slurm.out", "uninterrupted",
                                                            uninterrupted.log.name]


def test_a_closed_cluster_leaves_no_namespace_route_process_or_daemon(tmp_path):
    """Pass or fail, the emulated nodes go away whole: here with SLURM's daemons and a job still running on both."""
    cluster = Cluster(tmp_path)
    try:
        slurm = Slurm(cluster, subprocess_env())
        slurm.command("sbatch", "--nodes=2", "--ntasks-per-node=1", f"--output={tmp_path}/sleep.out", "--wrap",
                      "srun sleep 600")
        deadline = time.monotonic() + 60
        while not all(any("sleep" in Path(f"/proc/{pid}/cmdline").read_text() for pid in cluster.pids(node))
                      for node in range(2)):
            assert time.monotonic() < deadline, slurm.logs()
            time.sleep(0.2)
        daemons = [pid for node in range(2) for pid in cluster.pids(node)] + [slurm.munged.pid]
    finally:
        cluster.close()
    assert cluster.leftovers() == []
    assert slurm.munged.poll() is not None
    assert [pid for pid in daemons if alive(pid)] == []


def alive(pid: int) -> bool:
    """Running, or stopped: not gone, nor a zombie that only waits for init to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
