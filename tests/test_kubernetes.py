"""Kubernetes on this machine: the environment variables Kubeflow gives each pod, set on local processes, and the ranks
Fabric computes under them; and the world-size check, which stops flags that count other processes than a launcher
started (torchrun, SLURM, Kubeflow, Ray) with one line instead of wrong ranks.

A Kubeflow TrainJob (its torch runtime) runs ``torchrun`` in every pod with ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` set, which torchrun reads as its flags; a PyTorchJob
sets ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` and ``RANK`` (the pod's) and runs the command as given."""

import json
import subprocess
import sys

import pytest
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from conftest import REPO, build_fabric_from_flags, run, subprocess_env

PROBE = "tests/launcher_probe.py"
CPU = ["--accelerator", "cpu", "--precision", "32-true"]


def probe_env(**variables: str) -> dict:
    return {**subprocess_env(), "PYTHONPATH": str(REPO), **variables}  # the probe imports train.py


def pods(commands: list, envs: list) -> list[dict]:
    """Runs one command per emulated pod at once; each one's printed ranks (one JSON line per process)."""
    procs = [subprocess.Popen(command, cwd=REPO, env=probe_env(**env), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
             for command, env in zip(commands, envs)]
    printed = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        printed += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return sorted(printed, key=lambda ranks: ranks["global_rank"])


def test_a_trainjob_runs_torchrun_in_each_pod_and_fabric_takes_its_ranks():
    """Two pods of two processes each: torchrun with nothing but the pod's PET_ variables."""
    port = str(find_free_network_port())
    envs = [{"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": str(pod), "PET_MASTER_ADDR": "127.0.0.1",
             "PET_MASTER_PORT": port} for pod in (0, 1)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", PROBE, *CPU, "--devices", "2", "--num-nodes", "2"]
    assert pods([torchrun, torchrun], envs) == [
        {"environment": "TorchElasticEnvironment", "global_rank": rank, "world_size": 4, "node_rank": rank // 2,
         "local_rank": rank % 2, "group": [rank, 4]} for rank in range(4)]


def test_a_pytorchjob_without_torchrun_needs_kubeflows_environment_which_gives_the_pods_ranks():
    """One process per pod, told its rank by RANK: with ``FABRIC_TEMPLATE_CLUSTER=kubeflow`` in the manifest, Fabric
    takes Lightning's ``KubeflowEnvironment`` and the pods' ranks."""
    port = str(find_free_network_port())
    envs = [{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2", "RANK": str(pod)} for pod in (0, 1)]
    probe = [sys.executable, PROBE, *CPU, "--devices", "1", "--num-nodes", "2"]
    assert pods([probe, probe], [{**env, "FABRIC_TEMPLATE_CLUSTER": "kubeflow"} for env in envs]) == [
        {"environment": "KubeflowEnvironment", "global_rank": rank, "world_size": 2, "node_rank": rank,
         "local_rank": 0, "group": [rank, 2]} for rank in (0, 1)]


def test_a_pytorchjob_pod_without_kubeflows_environment_stops_with_one_line(monkeypatch):
    """Fabric would make the second pod rank 0 too (its NODE_RANK is unset)."""
    from fabric_utils.errors import UserError

    for variable, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "1"}.items():
        monkeypatch.setenv(variable, value)
    with pytest.raises(UserError) as error:
        build_fabric_from_flags(*CPU, "--devices", "1", "--num-nodes", "2")
    assert error.value.rank == 1 and str(error.value) == (
        "the launcher made this process rank 1 (RANK), but --devices 1 x --num-nodes 2 make it rank 0 (node 0 x 1 + "
        "local rank 0); launch through torchrun, or give Fabric the launcher's cluster environment "
        "(docs/launching.md)")


TORCHRUN_RANK_3_OF_4 = {"RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job"}
SLURM_TASK_3_OF_4 = {"SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                     "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "node[1-2]",
                     "SLURM_JOB_ID": "1"}


@pytest.mark.parametrize("variables, name", [(TORCHRUN_RANK_3_OF_4, "TorchElasticEnvironment"),
                                             (SLURM_TASK_3_OF_4, "SLURMEnvironment")], ids=["torchrun", "slurm"])
def test_flags_that_agree_with_the_launcher_give_its_ranks(monkeypatch, variables, name):
    for variable, value in variables.items():
        monkeypatch.setenv(variable, value)
    fabric = build_fabric_from_flags(*CPU, "--devices", "2", "--num-nodes", "2")
    environment = fabric.strategy.cluster_environment
    assert type(environment).__name__ == name
    assert (fabric.world_size, fabric.global_rank, environment.node_rank(), environment.local_rank()) == (4, 3, 1, 1)


@pytest.mark.parametrize("variables, name", [(TORCHRUN_RANK_3_OF_4, "TorchElasticEnvironment"),
                                             (SLURM_TASK_3_OF_4, "SLURMEnvironment"),
                                             ({"LOCAL_RANK": "1", "WORLD_SIZE": "4"}, "LightningEnvironment")],
                         ids=["torchrun", "slurm", "any-launcher"])
@pytest.mark.parametrize("devices, num_nodes", [("1", "1"), ("2", "1"), ("4", "2")])
def test_flags_that_count_other_processes_than_the_launcher_started_stop_with_one_line(
        monkeypatch, variables, name, devices, num_nodes):
    from fabric_utils.errors import UserError

    for variable, value in variables.items():
        monkeypatch.setenv(variable, value)
    with pytest.raises(UserError) as error:
        build_fabric_from_flags(*CPU, "--devices", devices, "--num-nodes", num_nodes)
    assert str(error.value) == (
        f"{name} started 4 processes, but --devices {devices} x --num-nodes {num_nodes} count "
        f"{int(devices) * int(num_nodes)}; pass --devices (processes per node) and --num-nodes that multiply to 4")


def test_the_world_size_check_exits_2_with_one_line_and_writes_nothing(tmp_path):
    """train.py itself, as torchrun's rank 0 of 4 would start it with ``--devices 2`` on one node."""
    out = tmp_path / "run"
    env = {**TORCHRUN_RANK_3_OF_4, "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"}
    done = run([sys.executable, "train.py", "--demo", *CPU, "--devices", "2", "--out-dir", str(out)], check=False,
               env=env)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "error: TorchElasticEnvironment started 4 processes, but --devices 2 x --num-nodes 1 count 2; pass --devices "
        "(processes per node) and --num-nodes that multiply to 4"], done.stderr[-3000:]
    assert not out.exists()


def test_a_launcher_not_known_by_name_is_one_line(monkeypatch):
    from fabric_utils.errors import UserError

    monkeypatch.setenv("FABRIC_TEMPLATE_CLUSTER", "k8s")
    with pytest.raises(UserError) as error:
        build_fabric_from_flags(*CPU)
    assert str(error.value) == ("FABRIC_TEMPLATE_CLUSTER=k8s is not a launcher this knows: set kubeflow or ray, or "
                                "unset it")
