"""One run per folder: a run holds its --out-dir's lock for its whole life, and a second run there is refused with
one line, touching nothing; a resume continues the same optimization or is refused with one line, and a refused
resume leaves the run's record (config.yaml) as it was."""

import fcntl
import sys

import task
from conftest import run
from train import parse_args


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
