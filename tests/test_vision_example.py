"""examples/vision_task.py is a drop-in task.py that sets only the contract's required part: in a copy of the
repository where it replaces task.py and nothing else changes, train.py trains a vision transformer on the digits under
fsdp2 (its blocks sharded) on two processes, and the export rebuilds, through the example's own load_exported, into a
model as accurate as the run said."""

import ast
import csv
import dataclasses
import importlib.util
import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO, copy_repo, subprocess_env
from fabric_utils.task_spec import TaskSpec

EXAMPLE = REPO / "examples" / "vision_task.py"


def load_example():
    spec = importlib.util.spec_from_file_location("vision_task", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vision_example_trains_under_fsdp2_and_its_export_loads(tmp_path):
    example = load_example()
    copy = copy_repo(tmp_path / "repo")
    shutil.copy2(EXAMPLE, copy / "task.py")
    out = tmp_path / "run"
    command = [sys.executable, "train.py", "--accelerator", "cpu", "--devices", "2", "--strategy", "fsdp2",
               *example.TEST_FLAGS, "--quiet", "--out-dir", str(out)]
    done = subprocess.run(command, cwd=copy, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-5000:]
    results = json.loads((out / "results.json").read_text())
    assert results["strategy"] == "ModelParallelStrategy" and results["world_size"] == 2
    assert results["test_acc"] >= 0.9, results  # ten classes: chance is 0.1, and TEST_FLAGS reach about 0.95

    model, classes = example.load_exported(out / "model")
    assert classes == [str(digit) for digit in range(10)]
    config = results["config"]
    test = example.load_splits(config["train_size"], config["val_size"], config["test_size"])[0]["test"]
    assert len(test) == results["test_examples"]
    with torch.no_grad():
        accuracy = (model(test.images).argmax(dim=1) == test.labels).float().mean().item()
    # the run evaluated under its own precision (bf16 autocast where the CPU has it), the export in fp32: at most
    # one row may round the other way
    assert abs(accuracy - results["test_acc"]) <= 1 / len(test) + 1e-6, (accuracy, results["test_acc"])
    with open(out / "test_predictions.csv", newline="") as f:  # the run's own, from both ranks' shards
        predictions = list(csv.DictReader(f))
    assert [int(row["row"]) for row in predictions] == list(range(len(test)))
    assert [int(row["label"]) for row in predictions] == test.labels.tolist()
    agreed = sum(row["label"] == row["predicted"] for row in predictions) / len(test)
    assert agreed == pytest.approx(results["test_acc"], abs=1e-6)


def test_a_task_reads_the_contract_in_minutes():
    """The contract's required part and optional part are at most six fields each, and the vision example, a whole
    task, sets only the required ones."""
    fields = dataclasses.fields(TaskSpec)
    required = {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert len(required) <= 6 and len(fields) - len(required) <= 6, [f.name for f in fields]
    calls = [node for node in ast.walk(ast.parse(EXAMPLE.read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "TaskSpec"]
    assert len(calls) == 1 and {keyword.arg for keyword in calls[0].keywords} == required
