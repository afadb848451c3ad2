"""The loop runs any task through the contract (fabric_utils/task_spec.py): these tests use only that contract and
the task's TEST_FLAGS, so they hold for whatever task.py is (CI swaps in examples/vision_task.py and runs them)."""

import ast
import json
import sys

import pytest
import torch

import task
from conftest import REPO, Job, kill_all, resumed_step, run
from fabric_utils.args import build_parser
from fabric_utils.sharding import block_classes
from fabric_utils.flops import count_flops
from fabric_utils.task_spec import TaskSpec
from train import flag_parser, parse_args


@pytest.fixture(scope="module")
def job() -> TaskSpec:
    return task.setup(parse_args([*task.TEST_FLAGS, "--quiet"]), verbose=False)


def test_the_task_gives_the_loop_what_the_contract_says(job):
    assert isinstance(job, TaskSpec)
    assert {name: len(job.datasets[name]) > 0 for name in ("train", "validation", "test")} == dict.fromkeys(
        ("train", "validation", "test"), True)
    if job.lengths:
        assert {name: len(lengths) for name, lengths in job.lengths.per_split.items()} == {
            name: len(dataset) for name, dataset in job.datasets.items()}
    batch = job.collate([job.datasets["train"][i] for i in range(3)])
    assert all(isinstance(value, torch.Tensor) and len(value) == 3 for value in batch.values()), batch.keys()
    model = job.build_model()
    outputs = job.objective.forward(model, batch)
    per_row = job.objective.loss(outputs, batch, reduction="none")
    assert per_row.shape == (3,) and torch.isclose(per_row.mean(), job.objective.loss(outputs, batch))
    metrics = job.objective.make_metrics()
    metrics.update(outputs, batch["labels"])
    assert job.objective.best_metric in metrics.compute()
    assert job.objective.is_better(1.0, None)
    assert block_classes(model)  # the repeated blocks fsdp2 shards and --grad-checkpointing recomputes
    if job.lengths:  # real rows only, never more than the longest
        assert (job.lengths.in_batch(batch) <= job.lengths.longest).all()
    # FLOPs are counted on fake tensors: the example batch must run there
    assert count_flops(model, lambda m, b: job.objective.loss(job.objective.forward(m, b), b),
                       [job.example_batch(2, None, "cpu")])[0] > 0


def task_flags() -> list[str]:
    """Every option string the task adds to the loop's parser."""
    loop = {option for action in build_parser("")._actions for option in action.option_strings}
    return sorted({option for action in flag_parser()._actions for option in action.option_strings} - loop)


def test_train_py_and_fabric_utils_name_no_task_flag_and_import_no_task_library():
    """A new task is a new task.py: the loop and its helpers never name the task's flags or import its libraries."""
    sources = {path.relative_to(REPO): path.read_text() for path in [REPO / "train.py",
                                                                      *sorted((REPO / "fabric_utils").glob("*.py"))]}
    named = {f"{path}: {flag}" for path, text in sources.items() for flag in task_flags() if flag in text}
    assert task_flags() and named == set()
    imported = set()
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            imported |= {f"{path}: {n}" for n in names if n.split(".")[0] in ("transformers", "datasets", "peft",
                                                                               "data", "sklearn")}
    assert imported == set()


@pytest.mark.parametrize("strategy", ["fsdp2", "deepspeed_stage_3"])
def test_evaluation_scores_every_row_once_whatever_the_split_and_batch(tmp_path, strategy):
    """1 to 13 rows on 2 processes, in batches of 1 to 50: every row counts once, and the loss does not depend on
    how rows fall into batches. The old loop hung here (a rank skipped the forward of a repeated-row batch)."""
    out = tmp_path / "sweep.json"
    run([sys.executable, "tests/infra/eval_sweep_job.py", strategy, str(out)], timeout=300,
        deepspeed_cpu=strategy.startswith("deepspeed"))
    found = json.loads(out.read_text())
    assert {r["examples"] for r in found if r["rows"] == 13} == {13}
    for rows in {r["rows"] for r in found}:
        same = [r for r in found if r["rows"] == rows]
        assert [r["examples"] for r in same] == [rows] * len(same)
        assert [r["loss"] for r in same] == pytest.approx([same[0]["loss"]] * len(same), rel=1e-4), rows


# two CPU processes, exact arithmetic, a checkpoint every 5 steps
LAUNCH = ["--accelerator", "cpu", "--devices", "2", "--strategy", "ddp", "--precision", "32-true", "--num-workers",
          "0", "--save-every", "5", "--log-every", "5", "--quiet"]


def test_a_run_killed_and_resumed_ends_where_an_uninterrupted_run_ends(tmp_path):
    """kill -9 of rank 1 after the step-5 checkpoint (a crashed process: rank 0 must end by itself), then --resume
    auto: the same steps, and the same validation and test figures as a run that was never interrupted (they start
    together). The interrupted run recomputes its blocks' activations in backward (--grad-checkpointing: the model's
    own checkpointing, else a wrapper around each of the task's blocks), which must change none of the figures."""
    flags = [*task.TEST_FLAGS, *LAUNCH]
    jobs = {"full": Job(tmp_path / "full", *flags), "killed": Job(tmp_path / "killed", *flags, "--grad-checkpointing")}
    try:
        jobs["killed"].kill_after("step-000005", rank=1)
        jobs["resumed"] = Job(tmp_path / "killed", *flags, "--grad-checkpointing", "--resume", "auto")
        full, resumed = jobs["full"].results(), jobs["resumed"].results()
    finally:
        kill_all(jobs)
    assert resumed_step(jobs["resumed"].output()) >= 5
    killed = jobs["killed"].output()
    assert "Traceback" not in killed and "its own output says why" not in killed, killed[-3000:]
    stopped = [line for line in killed.splitlines() if line.startswith("stopping: ")]
    # rank 0 says it, unless Lightning's launcher, which polls its children every 5 s, killed it first
    assert stopped in ([], ["stopping: rank 1's process was killed by SIGKILL"]), killed[-3000:]
    assert resumed["steps"] == full["steps"] and full["world_size"] == 2
    scores = [key for key in full if key.startswith(("val_", "test_"))]
    assert {"test_loss", "test_examples", "val_loss"} <= set(scores)
    assert {key: resumed[key] for key in scores} == pytest.approx({key: full[key] for key in scores}, abs=1e-4)


def test_fast_dev_run_checks_the_whole_run_and_leaves_nothing(tmp_path):
    """--fast-dev-run: a few steps, validation and test batches and the export, for whatever task.py is, in a
    temporary folder that is gone afterwards (runs/ untouched)."""
    import os
    import subprocess

    from conftest import subprocess_env

    runs_before = sorted((REPO / "runs").glob("*")) if (REPO / "runs").is_dir() else []
    done = subprocess.run([sys.executable, "train.py", *task.TEST_FLAGS, "--fast-dev-run", "3"], cwd=REPO,
                          env={**subprocess_env(), "TMPDIR": str(tmp_path)}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("training  3 optimizer steps") for line in lines), done.stdout
    assert any(line.startswith("step 3: val ") for line in lines) and lines[-1].startswith("--fast-dev-run: removed")
    assert not list(tmp_path.glob("fabric-template-check-*"))
    assert (sorted((REPO / "runs").glob("*")) if (REPO / "runs").is_dir() else []) == runs_before
    refused = subprocess.run([sys.executable, "train.py", *task.TEST_FLAGS, "--fast-dev-run", "--out-dir",
                              str(tmp_path / "run")], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode == 2 and refused.stderr == (
        "error: --fast-dev-run runs in a temporary folder it removes: drop --out-dir\n") and not os.path.exists(
        tmp_path / "run")
