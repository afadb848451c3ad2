"""Sharded and mixed-precision paths that train silently differently or refuse to start: FSDP1's weight decay (run on
2 CPU processes through the test-only shim in tests/shims/sitecustomize.py), ..."""

import os
import sys

import pytest

from conftest import REPO, SHIMS, SMALL_DEMO, run

TWO_CPUS = ["--accelerator", "cpu", "--devices", "2"]


@pytest.fixture(scope="module")
def fsdp1_run(tmp_path_factory):
    """``--strategy fsdp`` (torch's FSDP1) on 2 CPU processes, 2 steps, with a checkpoint at the end."""
    out_dir = tmp_path_factory.mktemp("fsdp1")
    env = {"FABRIC_TEMPLATE_FSDP_CPU": "1", "PYTHONPATH": os.pathsep.join([str(SHIMS), str(REPO)])}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        run([sys.executable, "train.py", *TWO_CPUS, "--strategy", "fsdp", *SMALL_DEMO, "--max-steps", "2",
             "--save-every", "2", "--out-dir", str(out_dir)])
    return out_dir


def test_fsdp1_decays_every_matrix_and_nothing_else(fsdp1_run):
    """FSDP1 hands the optimizer each parameter as a 1-D slice of its unit's flat shard (or an empty one): a rule by
    the shape it sees put every weight in the no-decay group."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    checkpoint = _load_distributed_checkpoint(fsdp1_run / "checkpoints" / "step-000002" / "state")
    groups = {group["weight_decay"]: set(group["params"]) for group in checkpoint["optimizer"]["param_groups"]}
    shapes = {name: weight.shape for name, weight in checkpoint["model"].items()}
    assert groups[0.01] == {name for name, shape in shapes.items() if len(shape) >= 2}
    assert groups[0.0] == {name for name, shape in shapes.items() if len(shape) < 2}
    assert (fsdp1_run / "model" / "model.safetensors").exists()  # consolidated from FSDP1's shards
