"""scripts/ray_train.py on a Ray cluster of two emulated nodes (tests/cluster.py), each started with its own
``ray start`` at its own address and one CPU, so each runs one of the two workers: the unchanged train.py ends with
the metrics of ``python train.py --devices 2``, also after ``kill -9`` of the worker on the second node, which Ray's
FailureConfig restarts with the whole group, continuing from the run folder's newest checkpoint."""

import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

from cluster import Nodes
from conftest import REPO, SMALL_DEMO, Job, node_env, resumed_step

pytest.importorskip("ray.train", reason="needs requirements-scale.txt")

RAY = str(Path(sys.executable).with_name("ray"))
FLAGS = [*SMALL_DEMO, "--accelerator", "cpu", "--precision", "32-true", "--batch-size", "8", "--max-steps", "40",
         "--epochs", "2", "--val-every", "10", "--save-every", "4"]
COMPARED = ("val_loss", "val_acc", "test_loss", "test_acc")


@pytest.fixture(scope="module")
def ray_cluster(cluster, tmp_path_factory):
    """A Ray head on node1 and a second Ray node on node2, one CPU each; (the head's address, each node's env)."""
    root = tmp_path_factory.mktemp("ray")
    sessions = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's sockets live there: a path of at most 107 bytes
    env = node_env(RAY_DISABLE_USAGE_STATS="1", RAY_TRAIN_ENABLE_STATE_TRACKING="0")
    head = f"{cluster.addresses[0]}:6379"
    common = ["--block", "--num-cpus", "1", "--num-gpus", "0", "--disable-usage-stats"]
    cluster.start(0, [RAY, "start", "--head", "--port", "6379", "--node-ip-address", cluster.addresses[0],
                      "--include-dashboard", "false", "--temp-dir", sessions, *common], env(0),
                  root / "node1-ray.log")
    cluster.start(1, [RAY, "start", "--address", head, "--node-ip-address", cluster.addresses[1], *common], env(1),
                  root / "node2-ray.log")
    yield head, env
    for node in (1, 0):
        cluster.kill_node(node)
    shutil.rmtree(sessions, ignore_errors=True)


def ray_train(cluster, head, env, root: Path, out: Path) -> Nodes:
    """scripts/ray_train.py started on node1: the driver, which Ray's workers on both nodes serve."""
    return Nodes(cluster, root, [[sys.executable, "scripts/ray_train.py", "--address", head, "--workers", "2",
                                  "--max-failures", "1", "--", *FLAGS, "--out-dir", out]], env, cwd=REPO, cold=False)


def ray_workers(cluster, node: int) -> list[int]:
    """The processes on ``node`` of Ray Train's workers (one per rank)."""
    def is_worker(pid: int) -> bool:
        try:
            return "RayTrainWorker" in Path(f"/proc/{pid}/cmdline").read_text()
        except OSError:
            return False
    return [pid for pid in cluster.pids(node) if is_worker(pid)]


def test_two_ray_nodes_end_with_the_metrics_of_two_devices_on_one_also_after_kill_9_of_a_worker(
        cluster, ray_cluster, tmp_path):
    """The worker on the second node is killed after the step-4 checkpoint: Ray restarts the group, which resumes
    from the run folder, and rank 0 reports the results and the exported model to Ray."""
    head, env = ray_cluster
    out = tmp_path / "run"
    one_node = Job(tmp_path / "one-node", *FLAGS, "--devices", "2")  # beside it
    driver = ray_train(cluster, head, env, tmp_path, out)
    driver.wait_for(out / "checkpoints" / "step-000004", timeout=600)
    (worker,) = ray_workers(cluster, 1)
    os.kill(worker, signal.SIGKILL)
    assert driver.wait(600) == [0], driver.output()
    log = driver.logs[0].read_text()
    results, expected = json.loads((out / "results.json").read_text()), one_node.results()
    assert resumed_step(log) >= 4 and results["steps"] == expected["steps"] == 40
    assert results["world_size"] == 2 and results["environment"]["num_nodes"] == 2
    assert {key: results[key] for key in COMPARED} == pytest.approx({key: expected[key] for key in COMPARED}, abs=1e-4)
    reported = [line for line in log.splitlines() if line.startswith("ray: ")][-1]
    assert f"'val_loss': {results['val_loss']}" in reported
    model = Path(reported.rsplit("model ", 1)[1])
    assert (model / "config.json").exists() and model.is_relative_to(Path(f"{out}-ray"))
