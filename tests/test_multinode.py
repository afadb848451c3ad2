"""Two nodes for real: the README's multi-node recipes on two emulated nodes (tests/cluster.py), each ending with the
metrics of the same world size on one node. The nodes start a second apart with cold node-local caches, as on a
cluster, and a job without --out-dir leaves one run folder in the folder both start in.

`fabric run --num-nodes 2` (1 and 2 processes per node); plain `python train.py` with NODE_RANK and MASTER_ADDR, stopped
by a signal to one node's rank (a fault, beside the others in test_multinode_faults.py: it stops every rank) and
resumed; and torchrun's c10d rendezvous, which restarts both nodes' workers when a worker on either node is killed."""

import itertools
import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from cluster import Nodes
from conftest import REPO, Job, fabric_cli, kill_all, node_env, resumed_step
from data.demo import prepare_demo
from fabric_utils.preemption import EXIT_PREEMPTED, STATUS_FILE
from test_resilience import COMPARED, TINY

TRAIN = str(REPO / "train.py")
ports = itertools.count(29400)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_like_one_node(results: dict, one_node: dict) -> None:
    assert results["world_size"] == one_node["world_size"] and results["environment"]["num_nodes"] == 2
    assert results["steps"] == one_node["steps"]
    assert {key: results[key] for key in COMPARED} == pytest.approx({key: one_node[key] for key in COMPARED},
                                                                    abs=1e-4)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> dict:
    """The same job on one node, from a warm cache: world size -> results. Four processes through `fabric run`,
    which starts more CPU processes than cores where train.py refuses to."""
    root = tmp_path_factory.mktemp("one-node")
    prepare_demo(Path.home() / ".cache" / "fabric-template" / "demo")
    jobs = {2: Job(root / "ws2", *TINY, "--devices", "2"),
            4: Job(root / "ws4", *TINY, launcher=(fabric_cli(), "run", "--accelerator", "cpu", "--devices", "4",
                                                  "--main-port", str(free_port())))}
    try:
        return {size: job.results() for size, job in jobs.items()}
    finally:
        kill_all(jobs)


@pytest.mark.parametrize("per_node", [1, 2])
def test_fabric_run_on_two_nodes_from_cold_caches_ends_like_one_node(cluster, one_node, tmp_path, per_node):
    work = tmp_path / "work"  # where both nodes start, with no --out-dir: each proposes a runs/<time> of its own
    work.mkdir()
    port = str(next(ports))
    nodes = Nodes(cluster, tmp_path, [[fabric_cli(), "run", "--accelerator", "cpu", "--devices", per_node,
                                       "--num-nodes", "2", "--node-rank", node, "--main-address", "node1",
                                       "--main-port", port, TRAIN, *TINY] for node in range(2)], node_env(), cwd=work,
                  apart=3)  # more than the nodes' start-up times differ by: each names runs/<time> seconds apart
    assert nodes.wait() == [0, 0], nodes.output()
    runs = list((work / "runs").iterdir())
    assert len(runs) == 1, f"one run folder per job, not {sorted(p.name for p in runs)}"
    assert_like_one_node(json.loads((runs[0] / "results.json").read_text()), one_node[2 * per_node])
    output = nodes.output()
    assert output.count("results in ") == 1, f"a line of the job printed once per node:\n{output}"
    for node in range(2):
        assert (cluster.home(node) / ".cache" / "fabric-template" / "demo" / "model" / "model.safetensors").exists()


def two_nodes(cluster, root, out, *flags, cold=False, env=None) -> Nodes:
    """``python train.py --num-nodes 2`` on each node, told its rank by NODE_RANK and the main node by MASTER_ADDR."""
    env = node_env(MASTER_ADDR="node1", MASTER_PORT=str(next(ports)), NODE_RANK=str, **(env or {}))
    return Nodes(cluster, root, [[sys.executable, TRAIN, *TINY, "--num-nodes", "2", "--devices", "1", "--out-dir", out,
                                  *flags]] * 2, env, cwd=REPO, cold=cold)


def test_torchrun_on_two_nodes_restarts_after_a_worker_on_either_node_is_killed_and_ends_like_one_node(
        cluster, one_node, tmp_path):
    """kill -9 of node1's worker, then, once the restarted workers have resumed, of node2's: each time both nodes'
    agents restart their workers, which join one process group again and resume from the newest checkpoint."""
    out = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"node1:{next(ports)}", "--rdzv-id", "job",
                "--max-restarts", "2"]
    nodes = Nodes(cluster, tmp_path, [[*torchrun, TRAIN, *TINY, "--num-nodes", "2", "--devices", "1", "--resume",
                                       "auto", "--out-dir", out]] * 2, node_env(), cwd=REPO, cold=False)
    nodes.wait_for(out / "checkpoints" / "step-000010")
    for killed in range(2):
        workers = nodes.train_py(killed)
        assert workers, f"no worker on node {killed + 1} to kill\n{nodes.output()}"
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 240
        while len(resumes(nodes)) <= killed:  # the restarted workers are back in the loop, from a checkpoint
            assert all(proc.poll() is None for proc in nodes.procs), nodes.output()
            assert time.monotonic() < deadline, nodes.output()
            time.sleep(0.05)
    assert nodes.wait() == [0, 0], nodes.output()
    assert len(resumes(nodes)) == 2 and min(resumes(nodes)) >= 10, nodes.output()
    assert_like_one_node(json.loads((out / "results.json").read_text()), one_node[2])


def resumes(nodes: Nodes) -> list[int]:
    """The step each resume of the job started from, whichever node its rank 0 ran on."""
    return [int(step) for log in nodes.logs for step in re.findall(r"resumed from \S+ at step (\d+)", log.read_text())]


def test_python_train_py_on_each_node_with_node_rank_stops_on_a_signal_to_one_node_and_resumes_like_one_node(
        cluster, one_node, tmp_path):
    """The recipe from cold caches: SIGUSR1 to node2's rank stops every rank on both nodes, and the same command again,
    with --resume auto, ends like the one-node run."""
    out = tmp_path / "run"
    nodes = two_nodes(cluster, tmp_path, out, "--resume", "auto", cold=True)
    nodes.wait_for(out / "checkpoints" / "step-000010")
    for pid in nodes.train_py(1):
        os.kill(pid, signal.SIGUSR1)
    assert nodes.wait() == [EXIT_PREEMPTED] * 2, nodes.output()
    assert "rank 1: SIGUSR1: stopping" in nodes.logs[1].read_text(), "the signal's rank did not say it got it"
    stopped = int(re.match(r"preempted at step (\d+)", (out / STATUS_FILE).read_text()).group(1))
    (tmp_path / "resumed").mkdir()
    resumed = two_nodes(cluster, tmp_path / "resumed", out, "--resume", "auto")
    assert resumed.wait() == [0, 0], resumed.output()
    assert resumed_step(resumed.output()) == stopped
    assert_like_one_node(json.loads((out / "results.json").read_text()), one_node[2])
