"""One run per folder: a run holds its --out-dir's lock for its whole life, and a second run there is refused with
one line, touching nothing; runs started together without --out-dir each take a folder of their own; a failed start
removes only what it wrote; a resume continues the same optimization or is refused with one line, and a refused
resume leaves the run's record (config.yaml) as it was."""

import fcntl
import os
import re
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

import task
from conftest import Job, digest, popen, run, subprocess_env
from fabric_utils.errors import UserError
from lightning.fabric.utilities.rank_zero import rank_zero_only

from fabric_utils.run_folder import RUN_DIR_ENV, RUN_MARKER, claim_out_dir, locked_run_folder, proposed_run_folder
from train import parse_args


@pytest.fixture(autouse=True)
def first_process(monkeypatch):
    """This test's process as rank 0 of node 0, with no run folder handed down: tests before it may leave either."""
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    monkeypatch.delenv("NODE_RANK", raising=False)
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)


def test_a_second_run_on_a_folder_in_use_is_refused_with_one_line(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    with open(out / ".lock", "a") as held:  # as a running train.py holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        done = run([sys.executable, "train.py", *task.TEST_FLAGS, "--accelerator", "cpu", "--num-workers", "0",
                    "--quiet", "--out-dir", str(out), "--resume", "auto"], check=False, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert [line for line in done.stderr.splitlines() if "error" in line.lower()] == [
        f"error: another run is using --out-dir {out} right now; let it finish, or pass another --out-dir"]
    assert [p.name for p in out.iterdir()] == [".lock"]


def test_a_resume_that_would_change_the_optimization_is_refused_and_leaves_the_record(tmp_path):
    flags = [*task.TEST_FLAGS, "--accelerator", "cpu", "--num-workers", "0", "--quiet", "--max-steps", "4",
             "--save-every", "2", "--out-dir", str(tmp_path)]
    run([sys.executable, "train.py", *flags])
    record = (tmp_path / "config.yaml").read_text()
    lr = parse_args(task.TEST_FLAGS).lr
    for changed, said in ((["--lr", "0.123"], f"written with --lr {lr} (now 0.123)"),
                          (["--grad-accum", "2"], "rows per optimizer step (--batch-size x devices x --grad-accum) ")):
        done = run([sys.executable, "train.py", *flags, *changed, "--resume", "auto"], check=False, timeout=300)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert done.returncode == 2 and len(errors) == 1 and said in errors[0], done.stderr[-3000:]
    assert (tmp_path / "config.yaml").read_text() == record
    assert not list(tmp_path.glob("config-resumed-*"))


TINY = [*task.TEST_FLAGS, "--batch-size", "8", "--max-steps", "1", "--quiet", "--num-workers", "0", "--accelerator",
        "cpu"]  # whatever task.py is
# what a run that trained leaves in its folder, whatever the task exports into model/
RUN_FILES = (".fabric-template-run", "config.yaml", "environment.json", "results.json", "test_predictions.csv",
             "logs/version_0/metrics.csv")
REFUSALS = ("error: another run is using --out-dir {out} right now; let it finish, or pass another --out-dir",
            "error: --out-dir {out} holds a run already; continue it with --resume auto, or pass a new --out-dir")


def assert_trained(folder: Path) -> None:
    for name in RUN_FILES:
        assert (folder / name).is_file(), f"{folder} lacks {name}: {sorted(folder.rglob('*'))}"
    assert any((folder / "model").iterdir()), f"{folder} has no exported model"
    assert [p.name for p in (folder / "logs").iterdir()] == ["version_0"]  # one run trained there
    assert not (folder / ".lock").exists()


@pytest.fixture(scope="module")
def starts(tmp_path_factory):
    """Started together: 4 runs without --out-dir, from a folder whose runs/ holds another's folder under each name
    of the next three minutes (so each run's first choice is taken, and the runs race for the next); and 4 runs with
    one --out-dir. Each group's outcome (exit status, output), and the hashes of the folders that must stay."""
    root = tmp_path_factory.mktemp("starts")
    now = datetime.now()
    for second in range(180):
        taken = root / "runs" / f"{now + timedelta(seconds=second):%Y%m%d-%H%M%S}"
        taken.mkdir(parents=True)
        (taken / "notes.txt").write_text("another's\n")
    before = digest(root / "runs")
    shared = root / "shared"
    unnamed = [popen([sys.executable, "train.py", *TINY], subprocess_env(), root / f"unnamed-{i}.log", cwd=root)
               for i in range(4)]
    named = [Job(shared, *TINY) for _ in range(4)]
    winner = None  # the shared folder's hashes as its run finished, to compare with what the others leave
    deadline = time.monotonic() + 600
    while any(job.proc.poll() is None for job in named) or any(proc.poll() is None for proc in unnamed):
        for job in named:
            if winner is None and job.proc.poll() == 0:
                winner = digest(shared)
        assert time.monotonic() < deadline, "the runs did not end within 10 minutes"
        time.sleep(0.05)
    if winner is None and any(job.proc.returncode == 0 for job in named):
        winner = digest(shared)
    outcomes = {"unnamed": [(proc.returncode, (root / f"unnamed-{i}.log").read_text())
                            for i, proc in enumerate(unnamed)],
                "named": [(job.proc.returncode, job.output()) for job in named]}
    return root, before, shared, winner, outcomes


def test_runs_started_together_without_out_dir_each_train_in_a_folder_of_their_own(starts):
    root, before, _, _, outcomes = starts
    folders = []
    for rc, output in outcomes["unnamed"]:
        assert rc == 0, output[-3000:]
        folders += re.findall(r"results in (\S+)/results.json", output)
    assert len(set(folders)) == 4, folders
    for folder in folders:
        assert_trained(root / folder)
    assert digest(root / "runs") == {**before, **{str(Path(folder).relative_to("runs") / name): sha
                                                  for folder in folders
                                                  for name, sha in digest(root / folder).items()}}


def test_runs_started_together_on_one_out_dir_one_trains_and_the_others_refuse_in_one_line(starts):
    _, _, shared, winner, outcomes = starts
    codes = sorted(rc for rc, _ in outcomes["named"])
    assert codes == [0, 2, 2, 2], [output[-2000:] for _, output in outcomes["named"]]
    for rc, output in outcomes["named"]:
        if rc == 2:
            assert output.splitlines() in ([line.format(out=shared)] for line in REFUSALS), output[-3000:]
    assert_trained(shared)
    assert digest(shared) == winner


def test_the_out_dir_is_checked_again_under_the_lock(tmp_path):
    """A run that finished between a start's first look and its lock: the start is refused, the run kept whole."""
    out = tmp_path / "run"
    rank_0 = SimpleNamespace(is_global_zero=True, broadcast=lambda obj: obj)
    with proposed_run_folder(str(out), resume=None) as proposed:
        for name, text in ((RUN_MARKER, "x"), ("results.json", "{}"), ("config.yaml", "lr: 0.1\n")):
            (out / name).write_text(text)
        finished = digest(out)
        with pytest.raises(UserError, match="holds a run already"), locked_run_folder(rank_0, proposed, None):
            pass
    assert digest(out) == finished and sorted(p.name for p in out.iterdir()) == sorted(finished)


def test_a_failed_start_removes_only_what_it_wrote(tmp_path):
    """Into an empty folder of the user's: the folder stays, empty; into a folder it made: the folder goes."""
    rank_0 = SimpleNamespace(is_global_zero=True, broadcast=lambda obj: obj)
    mine, made = tmp_path / "mine", tmp_path / "made"
    mine.mkdir()
    for out in (mine, made):
        with pytest.raises(RuntimeError), proposed_run_folder(str(out), resume=None) as proposed, \
                locked_run_folder(rank_0, proposed, None) as run_dir:
            (run_dir / "config.yaml").write_text("lr: 0.1\n")
            (run_dir / "logs").mkdir()
            raise RuntimeError("the data is bad")
    assert mine.is_dir() and not list(mine.iterdir()) and not made.exists()


def test_starts_in_the_same_second_claim_two_folders(tmp_path, monkeypatch):
    """Each takes the next free name, here past those another run holds (as runs/<time>-2)."""
    monkeypatch.chdir(tmp_path)
    now = datetime.now()
    for second in range(10):
        (tmp_path / "runs" / f"{now + timedelta(seconds=second):%Y%m%d-%H%M%S}").mkdir(parents=True)
    claimed = []
    for _ in range(2):
        monkeypatch.delenv(RUN_DIR_ENV, raising=False)
        claimed.append(claim_out_dir(None))
    (first, made_first), (second, made_second) = claimed
    assert made_first and made_second and first != second and first.parent == second.parent == Path("runs")
    assert first.name.count("-") == second.name.count("-") == 2, claimed
    assert os.environ[RUN_DIR_ENV] == str(second)  # what the processes Fabric starts take
