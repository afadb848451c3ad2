"""Faults across two emulated nodes (tests/cluster.py): a lost node ends the job on the other, a second job on another
node cannot take a run folder in use, and a hostname on loopback needs GLOO_SOCKET_IFNAME. (A signal that reaches one
node only: test_multinode.py, beside the one-node run it ends like.)"""

import os
import signal
import sys
import time

import pytest

from cluster import Nodes
from conftest import REPO, node_env
from test_multinode import TRAIN, two_nodes
from test_resilience import TINY


@pytest.mark.parametrize("lost", [0, 1])
def test_a_lost_node_ends_the_job_on_the_other(cluster, tmp_path, lost):
    out = tmp_path / "run"
    nodes = two_nodes(cluster, tmp_path, out)
    nodes.wait_for(out / "checkpoints" / "step-000010")
    killed_at = time.monotonic()
    cluster.kill_node(lost)
    survivor = 1 - lost
    status = nodes.procs[survivor].wait(120)
    assert status != 0 and time.monotonic() - killed_at < 60, nodes.output()
    assert cluster.pids(survivor) == [], "a process of the job outlived it"
    assert "Traceback" not in nodes.output()


def test_a_second_job_on_another_node_is_refused_the_run_folder_in_use(cluster, tmp_path):
    out = tmp_path / "run"
    slow = [*TINY, "--epochs", "1000"]  # still running when the second job starts
    first = Nodes(cluster, tmp_path, [[sys.executable, TRAIN, *slow, "--devices", "1", "--out-dir", out]], node_env(),
                  cwd=REPO, cold=False)
    first.wait_for(out / "checkpoints" / "step-000010")
    os.killpg(first.procs[0].pid, signal.SIGSTOP)  # in use still, holding its lock, without taking a core meanwhile
    second = cluster.run(1, [sys.executable, TRAIN, *slow, "--devices", "1", "--out-dir", out, "--resume", "auto"],
                         node_env()(1), cwd=REPO, timeout=300)
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"error: another run is using --out-dir {out} right now" in second.stderr
    assert first.procs[0].poll() is None, "the first job stopped"
    cluster.kill_node(0)


def test_nodes_whose_hostname_resolves_to_loopback_need_gloo_socket_ifname(cluster, tmp_path):
    """Debian's /etc/hosts names the machine 127.0.1.1: gloo (the preemption vote's backend, even on NCCL runs) then
    tells the other nodes to connect there; naming the interface the nodes share, as the README says, fixes it."""
    cluster.write_hosts(own_name_on_loopback=True)
    try:
        for variables, root in (({}, tmp_path / "loopback"), ({"GLOO_SOCKET_IFNAME": "eth0"}, tmp_path / "ifname")):
            root.mkdir()
            nodes = two_nodes(cluster, root, root / "run", "--max-steps", "2", env=variables)
            if variables:
                assert nodes.wait() == [0, 0], nodes.output()
                continue
            deadline = time.monotonic() + 120
            while "Gloo connectFullMesh failed" not in nodes.output():
                assert time.monotonic() < deadline, nodes.output()
                time.sleep(0.2)
            for node in range(2):
                cluster.kill_node(node)
    finally:
        cluster.write_hosts()
