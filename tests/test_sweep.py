"""scripts/sweep.py: an Optuna sweep whose trials are two-process runs of train.py, two at once. It prunes on the
validation metric each trial flushes, survives ``kill -9`` of the sweep (the same command continues it, rerunning the
interrupted trial in its own folder from its checkpoint) and leaves no process behind."""

import collections
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, SMALL_DEMO, subprocess_env

optuna = pytest.importorskip("optuna", reason="needs requirements-scale.txt")

TRIAL = [sys.executable, "train.py", *SMALL_DEMO, "--train-size", "96", "--val-size", "32", "--test-size", "32",
         "--accelerator", "cpu", "--precision", "32-true", "--devices", "2", "--batch-size", "8", "--max-steps", "6",
         "--val-every", "2", "--save-every", "2", "--warmup", "0"]
GOOD, BAD = 1e-4, 1.0  # a learning rate of 1 wrecks the model at its first steps: its validation loss is the worst


def sweep(study: Path, log: Path) -> subprocess.Popen:
    with open(log, "a") as output:
        return subprocess.Popen([sys.executable, "scripts/sweep.py", "--study-dir", str(study), "--trials", "4",
                                 "--parallel", "2", "--startup-trials", "1",
                                 "--param", "lr=1e-6:1:log", "--", *TRIAL], cwd=REPO, env=subprocess_env(),
                                stdout=output, stderr=subprocess.STDOUT, start_new_session=True)


def processes_naming(text: str) -> list[str]:
    """The command lines of the processes on this machine that name ``text``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().split(b"\0")
        except OSError:  # ended meanwhile
            continue
        if any(text.encode() in word for word in words) and cmdline.parent.name != str(os.getpid()):
            found.append(b" ".join(words).decode(errors="replace"))
    return found


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.2)


def test_a_sweep_of_two_process_trials_prunes_survives_kill_9_and_leaves_no_process(tmp_path):
    study_dir, log = tmp_path / "study", tmp_path / "sweep.log"
    study_dir.mkdir()
    storage = f"sqlite:///{study_dir / 'study.db'}"
    study = optuna.create_study(study_name="sweep", storage=storage)
    for lr in (GOOD, GOOD * 2, BAD, GOOD * 3):  # the third is pruned once the first two finished
        study.enqueue_trial({"lr": lr})
    first = sweep(study_dir, log)
    try:
        # the fourth trial saved a checkpoint: the sweep dies, as on a lost machine, and its trials with it
        wait_until(lambda: list((study_dir / "trial-0003" / "checkpoints").glob("step-*")) or first.poll() is not None,
                   600, "the fourth trial checkpointed")
        assert first.poll() is None, log.read_text()[-3000:]
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        wait_until(lambda: not processes_naming(str(study_dir)), 60, "the killed sweep's trials ended")
        assert not (study_dir / "trial-0003" / "results.json").exists()

        again = sweep(study_dir, log)
        assert again.wait(600) == 0, log.read_text()[-3000:]
    finally:
        for proc in (first, locals().get("again")):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert processes_naming(str(study_dir)) == []

    trials = optuna.load_study(study_name="sweep", storage=storage).trials
    finished = {trial.user_attrs["folder"]: trial for trial in trials if trial.state.name in ("COMPLETE", "PRUNED")}
    assert sorted(Path(folder).name for folder in finished) == [f"trial-{n:04d}" for n in range(4)]
    states = {Path(folder).name: (trial.params["lr"], trial.state.name) for folder, trial in finished.items()}
    assert states == {"trial-0000": (GOOD, "COMPLETE"), "trial-0001": (GOOD * 2, "COMPLETE"),
                      "trial-0002": (BAD, "PRUNED"), "trial-0003": (GOOD * 3, "COMPLETE")}, states
    # the interrupted trial reran in its folder, from its checkpoint, to the end
    assert "resumed from" in (study_dir / "trial-0003.log").read_text()
    assert (study_dir / "trial-0003" / "results.json").exists()
    assert "best: trial" in log.read_text() and (study_dir / "trials.png").exists()
    rerun = finished[str(study_dir / "trial-0003")]
    assert rerun.value == pytest.approx(json.loads((study_dir / "trial-0003" / "results.json").read_text())["val_loss"])


# a stand-in trial: writes the flags' --lr as its validation loss, where train.py writes it
FAKE_TRIAL = """import argparse, json, pathlib
parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float)
parser.add_argument("--out-dir")
parser.add_argument("--resume")
args = parser.parse_args()
logs = pathlib.Path(args.out_dir, "logs", "version_0")
logs.mkdir(parents=True)
(logs / "metrics.csv").write_text(f"step,val/loss\\n1,{args.lr}\\n")
pathlib.Path(args.out_dir, "results.json").write_text(json.dumps({"val_loss": args.lr}))
"""


def test_a_continued_sweep_draws_values_it_has_not_drawn(tmp_path):
    """The sampler's seed is offset by the trials the study holds: with one seed alone, the continued sweep's first
    draws would repeat the first sweep's."""
    command = ["--param", "lr=1e-6:1:log", "--", sys.executable, "-c", FAKE_TRIAL]
    for trials in ("2", "4"):
        done = subprocess.run([sys.executable, "scripts/sweep.py", "--study-dir", str(tmp_path), "--trials", trials,
                               *command], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    trials = optuna.load_study(study_name="sweep", storage=f"sqlite:///{tmp_path / 'study.db'}").trials
    assert [trial.state.name for trial in trials] == ["COMPLETE"] * 4
    assert len({trial.params["lr"] for trial in trials}) == 4
    assert [trial.value for trial in trials] == [trial.params["lr"] for trial in trials]


def test_trials_at_once_never_take_the_same_queued_trial(tmp_path):
    """Optuna reads a queued trial's state, then sets it: on SQLite's default transactions two threads may both take
    it (optuna#4002), so a trial ran twice in one folder and the sweep crashed; a rerun trial is queued the same way."""
    spec = importlib.util.spec_from_file_location("sweep", REPO / "scripts" / "sweep.py")
    sweep_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep_module)
    study = optuna.create_study(storage=sweep_module.study_storage(tmp_path / "study.db"))
    for x in range(24):
        study.enqueue_trial({"x": float(x)})
    runs = collections.Counter()

    def objective(trial):
        runs[trial.number] += 1
        time.sleep(0.02)
        return trial.suggest_float("x", 0, 24)

    study.optimize(objective, n_trials=24, n_jobs=8, catch=())
    assert sorted(runs.values()) == [1] * 24
    assert sorted(trial.params["x"] for trial in study.trials) == [float(x) for x in range(24)]
