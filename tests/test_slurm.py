"""scripts/slurm.sbatch: its requeue decision (issue 20), and the script itself on a real single-machine SLURM: a job
preempted with ``scancel --signal=USR1`` is requeued, resumes and ends with the uninterrupted run's metrics (issues
18 and 20). The SLURM test starts munged, slurmctld and slurmd as root from a slurm.conf in a temporary folder (this
machine is the only node) and stops them at the end; it is skipped where SLURM is not installed (CI installs it)."""

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, Job, resumed_step, subprocess_env
from fabric_utils.preemption import STATUS_FILE, write_atomically
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
    if status_file:
        write_atomically(tmp_path / STATUS_FILE, f"preempted at step 80, checkpoint {tmp_path}/step-000080\n")
    decided = subprocess.run(["bash", "scripts/requeue.sh", str(status), str(tmp_path)], cwd=REPO)
    assert decided.returncode == (0 if requeue else 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SLURM_CONF = """\
ClusterName=fabric-template-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node SLURM on this machine; yields the environment its commands need (SLURM_CONF)."""
    if not shutil.which("slurmctld") or not shutil.which("munged"):
        pytest.skip("SLURM is not installed (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("starts SLURM's daemons, which need root")
    root = tmp_path_factory.mktemp("slurm")
    (root / "state").mkdir()
    (root / "spool").mkdir()
    key = root / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=socket.gethostname(), ctld_port=free_port(), slurmd_port=free_port(),
                                      root=root, cpus=os.cpu_count()))
    env = {**subprocess_env(), "SLURM_CONF": str(conf)}
    # in the foreground, so that stopping them is ours to do; --force: munged refuses to run as root otherwise
    daemons = [subprocess.Popen(["munged", "--foreground", "--force", f"--socket={root}/munge.socket",
                                 f"--key-file={key}", f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log",
                                 f"--seed-file={root}/munged.seed"])]
    time.sleep(0.5)
    daemons += [subprocess.Popen(["slurmctld", "-D", "-c"], env=env), subprocess.Popen(["slurmd", "-D"], env=env)]
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(["sinfo", "--noheader", "--format=%T"], env=env, capture_output=True,
                             text=True).stdout.strip() != "idle":
            assert time.monotonic() < deadline, "the SLURM node did not come up\n" + logs(root)
            time.sleep(0.5)
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=env)
        for daemon in reversed(daemons):
            daemon.terminate()
            daemon.wait(30)


def slurm_command(env: dict, *command: str) -> str:
    return subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout


def logs(root) -> str:
    return "".join(f"--- {path.name}\n{path.read_text()[-2000:]}" for path in sorted(root.glob("*.log")))


def job_field(env: dict, job: str, field: str) -> str:
    return re.search(rf"\b{field}=(\S+)", slurm_command(env, "scontrol", "show", "job", job)).group(1)


def wait_for_job(env: dict, job: str, until, log, timeout=300) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert job_field(env, job, "JobState") not in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), log.read_text()
        assert time.monotonic() < deadline, f"job {job}: {job_field(env, job, 'JobState')}\n{log.read_text()}"
        time.sleep(0.2)


def test_preempted_slurm_job_is_requeued_and_finishes_like_an_uninterrupted_run(slurm, tmp_path):
    # the node's 2 CPUs as 2 tasks; the script's own --num-nodes 2 --devices 4 --strategy deepspeed_stage_2 are
    # overridden by these flags, which come after them
    flags = [*TINY, "--num-nodes", "1", "--devices", "2", "--strategy", "ddp"]  # 50 steps, a checkpoint every 10
    out, log = tmp_path / "slurm-run", tmp_path / "slurm.out"
    env = {**slurm, "OUT_DIR": str(out), "PYTHON": sys.executable}
    job = slurm_command(env, "sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0",
                        "--cpus-per-task=1", f"--output={log}", "scripts/slurm.sbatch", *flags).strip()
    uninterrupted = Job(tmp_path / "uninterrupted", *flags)  # beside it, started by Lightning's launcher

    wait_for_job(env, job, lambda: list((out / "checkpoints").glob("step-*")), log)
    slurm_command(env, "scancel", "--signal=USR1", job)
    wait_for_job(env, job, lambda: job_field(env, job, "Restarts") == "1"
                 and job_field(env, job, "JobState") == "PENDING", log)
    stopped = re.search(r"preempted: saved a checkpoint at step (\d+)", log.read_text())
    assert stopped, log.read_text()
    # else SLURM holds a requeue 2 min. Not "now": slurmd refuses a job whose credential is from the same second as
    # the last run's kill ("Job 1 already killed, do not launch batch job"), and the requeued job ends FAILED
    slurm_command(env, "scontrol", "update", f"JobId={job}", "StartTime=now+2")
    wait_for_job(env, job, lambda: job_field(env, job, "JobState") == "COMPLETED", log)

    output = log.read_text()
    assert resumed_step(output) == int(stopped.group(1)), output
    assert "Traceback" not in output and "terminate called" not in output, output
    results, full = json.loads((out / "results.json").read_text()), uninterrupted.results()
    assert results["world_size"] == 2 and results["strategy"] == "DDPStrategy", results
    assert results["steps"] == full["steps"] == 50
    for key in COMPARED:
        assert results[key] == pytest.approx(full[key], abs=1e-4), key
