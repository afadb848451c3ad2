"""The training loop end to end: the offline demo, two CPU processes launched both ways, accumulation."""

import csv
import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
import yaml

import task
from conftest import (REPO, SMALL_DEMO, Job, build_fabric_from_flags, fabric_cli, kill_all, logged, resumed_step, run,
                      subprocess_env, train)
from fabric_utils.batch_size import MAX_BATCH, find_batch_size
from train import parse_args

SMALL_SIZES = {"train_examples": 400, "val_examples": 101, "test_examples": 201}


def test_demo_learns_and_leaves_a_complete_run_folder(tmp_path):
    # the README's first command, and a folder
    done = run([sys.executable, "train.py", "--demo", "--quiet", "--out-dir", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert "chance level" not in done.stdout  # it learns: never said to be stuck
    assert results["test_acc"] >= 0.9
    assert results["test_examples"] == 1000 and results["world_size"] == 1
    assert results["val_examples"] + results["train_examples"] == 4000
    for name in ("config.yaml", "loss.png", "acc.png", "logs/version_0/metrics.csv", "model/config.json",
                 "model/tokenizer.json", "model/model.safetensors"):
        assert (tmp_path / name).exists(), name
    # one copy of the best weights, model/'s: checkpoints/best went once the run had finished
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [f"step-{results['steps']:06d}"]
    assert {"train_tokens_per_s", "train_samples_per_s", "peak_memory_mb_per_rank", "train_time_s", "environment",
            "config"} <= set(results)
    assert json.loads((tmp_path / "model" / "config.json").read_text())["id2label"] == {"0": "negative",
                                                                                      "1": "positive"}
    config = yaml.safe_load((tmp_path / "config.yaml").read_text())  # what it trained, not the flags' defaults
    assert config["model"] == results["config"]["model"] == str(task.DEMO_ROOT / "model")
    assert config["dataset"] == str(task.DEMO_ROOT / "data")
    assert (tmp_path / "environment.json").is_file() and not (tmp_path / ".lock").exists()
    predictions = read_predictions(tmp_path)
    assert [int(row["row"]) for row in predictions] == list(range(1000))  # every test row once, in order
    assert accuracy(predictions) == pytest.approx(results["test_acc"], abs=1e-6)
    names = ["negative", "positive"]  # each label by name too, and each class's probability
    assert all(row["label_name"] == names[int(row["label"])] and row["predicted_name"] == names[int(row["predicted"])]
               and float(row["score"]) == max(float(row["score_negative"]), float(row["score_positive"]))
               for row in predictions)

    # predict.py on the test file gives the run's own predictions, from the export, without labels
    run([sys.executable, "predict.py", str(tmp_path), str(task.DEMO_ROOT / "data" / "test.parquet")])
    with open(tmp_path / "predictions.csv", newline="") as f:
        new_rows = list(csv.DictReader(f))
    assert [row["row"] for row in new_rows] == [row["row"] for row in predictions]
    agree = sum(new["predicted"] == old["predicted"] for new, old in zip(new_rows, predictions))
    assert agree >= 0.99 * len(predictions)  # fp32 here, the run's precision there: a borderline row may flip
    (tmp_path / "untitled.csv").write_text("review\nfine\n")
    done = run([sys.executable, "predict.py", str(tmp_path), str(tmp_path / "untitled.csv")], check=False)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"error: {tmp_path / 'untitled.csv'} has no column 'text' (its columns: ['review']); the model was trained "
        f"on text"]
    run([sys.executable, "predict.py", str(tmp_path), str(tmp_path / "untitled.csv"), "--text-column", "review"])
    with open(tmp_path / "predictions.csv", newline="") as f:
        [row] = list(csv.DictReader(f))
    assert row["predicted_name"] in names and {"score_negative", "score_positive"} <= set(row)


def read_predictions(out_dir) -> list[dict]:
    with open(out_dir / "test_predictions.csv", newline="") as f:
        return list(csv.DictReader(f))


def accuracy(predictions: list[dict]) -> float:
    return sum(row["label"] == row["predicted"] for row in predictions) / len(predictions)


# the run's own lines, and nothing from the libraries underneath: the header, progress, validation, the result, and
# the line a run stuck at chance gets (a slice this small may not learn)
OUTPUT_LINE = re.compile(r"(data|training|launch|run) {2,}\S.*|step \d+/\d+ \(epoch \d+/\d+\): loss .*, "
                         r"[\d.]+ rows/s, \d+:\d\d:\d\d left|step \d+: val loss .*|test acc .* results in .*|"
                         r"the training loss stayed at chance level .*|"
                         r"(validation|test): \d+/\d+ batches, \d+:\d\d:\d\d left")


# 16 rows per optimizer step in exact arithmetic: the same updates however the processes and micro-batches split them
EXACT = ["--precision", "32-true", "--attention-dropout", "0", "--hidden-dropout", "0", "--no-group-by-length",
         "--max-steps", "3", "--val-every", "3", *SMALL_DEMO]


@pytest.fixture(scope="module")
def two_cpus(tmp_path_factory):
    """``python train.py`` on two CPU processes, its output shown as a log shows it (a line a step): EXACT's steps as 8
    rows per process, 4 at a time accumulated. (completed process, run folder)"""
    out_dir = tmp_path_factory.mktemp("two-cpus")
    shown = [flag for flag in EXACT if flag != "--quiet"]
    done = run([sys.executable, "train.py", "--accelerator", "cpu", "--devices", "2", *shown, "--batch-size", "4",
                "--grad-accum", "2", "--log-every", "1", "--logger", "csv,tensorboard", "--out-dir", str(out_dir)])
    return done, out_dir


@pytest.mark.parametrize("launch", ["python", "fabric run"])
def test_two_cpu_processes_count_every_row_once(request, tmp_path, launch):
    flags = ["--accelerator", "cpu", "--devices", "2"]
    if launch == "python":
        done, out_dir = request.getfixturevalue("two_cpus")
        assert not done.stderr, done.stderr[-3000:]
        assert all(OUTPUT_LINE.fullmatch(line) for line in done.stdout.splitlines()), done.stdout
        assert sum(line.startswith("step ") and " left" in line for line in done.stdout.splitlines()) >= 3
        results = json.loads((out_dir / "results.json").read_text())
    else:
        out_dir = tmp_path
        # as a user starts it: `fabric run` then sets OMP_NUM_THREADS to every CPU in each process
        env = {name: value for name, value in subprocess_env().items() if name != "OMP_NUM_THREADS"}
        done = subprocess.run([fabric_cli(), "run", *flags, "train.py", *SMALL_DEMO, "--out-dir", str(out_dir)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results = json.loads((out_dir / "results.json").read_text())
        # the two processes share the cores (the idle ones) instead of each starting a thread per core
        assert 1 <= results["environment"]["torch_threads"] <= max(1, len(os.sched_getaffinity(0)) // 2)
    assert results["world_size"] == 2
    assert {k: results[k] for k in SMALL_SIZES} == SMALL_SIZES
    peaks = results["peak_memory_mb_per_rank"]  # each rank's own resident peak, not rank 0's twice
    assert len(peaks) == 2 and all(peak > 100 for peak in peaks) and peaks[0] != peaks[1]
    predictions = read_predictions(out_dir)  # gathered from both ranks: every row once, none of the repeated ones
    assert [int(row["row"]) for row in predictions] == list(range(SMALL_SIZES["test_examples"]))
    assert accuracy(predictions) == pytest.approx(results["test_acc"], abs=1e-6)
    if launch == "python":
        assert list((out_dir / "tensorboard").rglob("events.out.tfevents.*"))


@pytest.fixture(scope="module")
def torchrun_runs(tmp_path_factory):
    """Under torchrun --max-restarts 2 with --resume auto, a job whose worker is killed with kill -9 after the step-4
    checkpoint; beside it, the same flags on a run never interrupted: (restarted job, its results, full results)."""
    root = tmp_path_factory.mktemp("torchrun")
    flags = ["--accelerator", "cpu", "--devices", "2", "--strategy", "ddp", "--precision", "32-true", *SMALL_DEMO,
             "--max-steps", "12", "--save-every", "4", "--resume", "auto"]
    torchrun = ("-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "2", "--master-port",
                str(29500 + os.getpid() % 1000 + 1))
    jobs = {"full": Job(root / "full", *flags), "restarted": Job(root / "restarted", *flags, launcher=torchrun)}
    try:
        restarted = jobs["restarted"]
        restarted.wait_for(root / "restarted" / "checkpoints" / "step-000004")
        os.kill(restarted.children()[-1], signal.SIGKILL)
        return restarted, restarted.results(), jobs["full"].results()
    finally:
        kill_all(jobs)


def test_torchrun_launch(torchrun_runs):
    _, results, _ = torchrun_runs
    assert results["world_size"] == 2 and results["test_examples"] == SMALL_SIZES["test_examples"]


def test_torchrun_restarts_a_killed_worker_and_the_job_ends_like_an_uninterrupted_run(torchrun_runs):
    """Both workers restarted, they resume from the newest checkpoint and end with the metrics of the run never
    interrupted."""
    restarted, resumed, full = torchrun_runs
    assert resumed_step(restarted.output()) >= 4 and resumed["steps"] == full["steps"] == 12
    compared = ("val_loss", "val_acc", "test_loss", "test_acc")
    assert {key: resumed[key] for key in compared} == pytest.approx({key: full[key] for key in compared}, abs=1e-4)


def test_grad_accumulation_matches_a_larger_batch(tmp_path, two_cpus):
    """16 rows per step as 1x16, 2x8 accumulated, and 2 processes x 8: the same rows, the same updates."""
    one = train([*EXACT, "--batch-size", "16"], tmp_path / "one")
    accumulated = train([*EXACT, "--batch-size", "8", "--grad-accum", "2"], tmp_path / "accum")
    ddp = json.loads((two_cpus[1] / "results.json").read_text())
    assert one["val_loss"] != pytest.approx(0.6931, abs=1e-3)  # it did learn something in 3 steps
    assert accumulated["val_loss"] == pytest.approx(one["val_loss"], rel=1e-4)
    assert ddp["val_loss"] == pytest.approx(one["val_loss"], rel=1e-4)
    accumulated_rows = accumulated["train_samples_per_s"] * accumulated["train_time_s"]
    assert accumulated_rows == pytest.approx(3 * 16)


def test_config_file_reruns_with_flag_overrides(tmp_path):
    first = parse_args(["--lr", "0.01", "--batch-size", "8", "--scheduler", "cosine"])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(vars(first)))
    again = parse_args(["--config", str(path), "--batch-size", "4"])
    assert (again.lr, again.scheduler, again.batch_size) == (0.01, "cosine", 4)


class EmulatedMemoryModel(torch.nn.Module):
    """Runs out of "memory" (budget in parameters' worth of floats) when its rows, at one parameter count each,
    plus the optimizer's state exceed the budget, the way a GPU would raise."""

    def __init__(self, budget_rows: int):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.budget = budget_rows * self.size()
        self.optimizer = None

    def size(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids, labels):
        state = self.optimizer.state.values() if self.optimizer else []
        held = sum(t.numel() for moments in state for t in moments.values() if torch.is_tensor(t))
        if len(input_ids) * self.size() + held > self.budget:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.embed(input_ids).sum()


# rows of 8 tokens, and the loss: the model's own output
PROBE = {"make_batch": lambda rows: {"input_ids": torch.randint(0, 10, (rows, 8)), "labels": torch.zeros(rows)},
         "loss_fn": lambda model, batch: model(**batch)}


def setup_emulated(budget_rows: int, optimizer_state: bool = False):
    fabric = build_fabric_from_flags("--accelerator", "cpu", "--precision", "32-true")
    fabric.launch()
    model = EmulatedMemoryModel(budget_rows)
    wrapped, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1.0, weight_decay=0.1))
    model.optimizer = optimizer if optimizer_state else None
    return fabric, wrapped, optimizer


def test_batch_size_finder_stops_at_the_first_out_of_memory():
    for limit, expected in ((MAX_BATCH, 16), (4, 4)):
        fabric, model, optimizer = setup_emulated(budget_rows=16)
        assert find_batch_size(fabric, model, optimizer, limit=limit, **PROBE) == expected


def test_batch_size_finder_pays_for_the_optimizer_state_then_drops_it():
    """Adam's two moments take two rows' worth here: 16 rows fit the budget alone, only 8 beside the state; after
    the probe the weights, learning rate and (empty) state are as before."""
    fabric, model, optimizer = setup_emulated(budget_rows=16, optimizer_state=True)
    weights = [p.detach().clone() for p in model.parameters()]
    assert find_batch_size(fabric, model, optimizer, **PROBE) == 8
    assert all(torch.equal(before, after) for before, after in zip(weights, model.parameters()))
    assert not optimizer.state and optimizer.param_groups[0]["lr"] == 1.0


def test_early_stop_ends_the_run_and_still_tests_the_best_model(tmp_path):
    """--early-stop 2: two validations in a row without a better accuracy end training before --epochs; the best
    checkpoint is still tested and exported."""
    results = train([*SMALL_DEMO, "--epochs", "4", "--val-every", "2", "--early-stop", "2"], tmp_path)
    full_steps = 4 * 25  # 400 rows in batches of 16, 4 epochs
    assert results["steps"] < full_steps
    accuracies = list(logged(tmp_path, "val/acc").values())
    assert accuracies[-1] <= max(accuracies[:-1]) and accuracies[-2] <= max(accuracies[:-2])  # two without a gain
    assert results["val_acc"] == max(accuracies)  # the best model is the one tested and exported
    assert (tmp_path / "model" / "config.json").exists()


def test_a_line_is_printed_once_per_job_not_once_per_node(monkeypatch, capsys):
    """Global rank 2 of 2 nodes of 2 processes is its node's first process, where fabric.print prints too."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from fabric_utils.progress import say

    for rank, line in ((2, "on the second node"), (1, "on rank 1"), (0, "on rank 0")):
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        say(line)
    assert capsys.readouterr().out == "on rank 0\n"
