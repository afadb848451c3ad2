"""Resilient runs: exact resume after SIGKILL, clean stop on SIGTERM (one and two processes), checkpoints
that --resume auto can trust, --keep-last, the exported model, and a loss that goes non-finite.

Every run is ``python train.py`` in a process of its own on the CPU. To keep the module at about a minute and a half on two
shared cores, the single-process runs start together in one fixture and each test checks its part of them."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from conftest import Job, kill_all, logged, resumed_step, run, subprocess_env, when_saved
from fabric_utils.checkpoint import write_manifest

EXIT_PREEMPTED = 75
STEPS_PER_EPOCH = 50  # 800 rows / 16 per batch
MAX_STEPS = 2 * STEPS_PER_EPOCH
# a slice of the demo that still learns (test accuracy ~0.9) in 100 fp32 steps of a few milliseconds each
TINY = ["--demo", "--accelerator", "cpu", "--precision", "32-true", "--num-workers", "0", "--max-length", "128",
        "--train-size", "800", "--val-size", "48", "--test-size", "64", "--batch-size", "16", "--epochs", "2",
        "--lr", "4e-3", "--save-every", "10", "--log-every", "5", "--quiet"]
COMPARED = ("val_loss", "val_acc", "test_loss", "test_acc")


def step_dirs(out_dir: Path) -> list[str]:
    return sorted(p.name for p in (out_dir / "checkpoints").glob("step-*"))


def plant_damaged_checkpoints(ckpt_dir: Path) -> None:
    """What a crash or a hand copy can leave behind, all newer than any real checkpoint of the run."""
    tmp = ckpt_dir / ".tmp-step-000099"  # killed mid-write: renamed only once complete
    tmp.mkdir()
    (tmp / "state").write_bytes(b"half a checkpoint")
    (tmp / "rng-rank0.pt").write_bytes(b"garbage")
    no_rng = ckpt_dir / "step-000098"  # its RNG file lost since it was written
    no_rng.mkdir()
    (no_rng / "state").write_bytes(b"garbage")
    (no_rng / "rng-rank0.pt").write_bytes(b"garbage")
    write_manifest(no_rng)
    (no_rng / "rng-rank0.pt").unlink()
    empty_state = ckpt_dir / "step-000097"  # its state file emptied since
    empty_state.mkdir()
    (empty_state / "state").write_bytes(b"garbage")
    (empty_state / "rng-rank0.pt").write_bytes(b"garbage")
    write_manifest(empty_state)
    (empty_state / "state").write_bytes(b"")
    (ckpt_dir / "step-000096").mkdir()  # an empty folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Starts together: an uninterrupted run, one to SIGKILL mid-epoch, one to SIGTERM mid-epoch and one with an
    absurd learning rate; then resumes the two interrupted ones (also together)."""
    root = tmp_path_factory.mktemp("resilience")
    jobs = {"full": Job(root / "full", *TINY), "killed": Job(root / "killed", *TINY),
            "termed": Job(root / "termed", *TINY),
            "nonfinite": Job(root / "nonfinite", *TINY, "--lr", "1e6", "--grad-clip", "0", "--max-steps", "40")}

    killed, termed = jobs["killed"], jobs["termed"]
    # each is signalled once its own checkpoint is seen (written by a rename: whole once seen)
    when_saved({job: (job.out_dir / "checkpoints" / "step-000020", partial(job.proc.send_signal, signum))
                for job, signum in ((killed, signal.SIGKILL), (termed, signal.SIGTERM))})
    info = {"killed_rc": killed.wait(), "killed_steps": step_dirs(root / "killed"),
            "killed_results": (root / "killed" / "results.json").exists(),
            "termed_rc": termed.wait(), "termed_output": termed.output(), "termed_steps": step_dirs(root / "termed")}

    plant_damaged_checkpoints(root / "killed" / "checkpoints")
    jobs["killed_resume"] = Job(root / "killed", "--resume", "auto")  # the rest from the folder's config.yaml
    jobs["termed_resume"] = Job(root / "termed", *TINY, "--resume", "auto")
    for name, signum in (("killed_saving", signal.SIGKILL), ("termed_saving", signal.SIGTERM)):
        job = jobs[name] = Job(root / name, *TINY, *SAVING)
        info[f"{name}_in_flight"] = signal_mid_save(job, signum)
        info[f"{name}_rc"], info[f"{name}_output"] = job.wait(), job.output()
        info[f"{name}_left"] = sorted(p.name for p in (job.out_dir / "checkpoints").iterdir())
        jobs[f"{name}_resume"] = Job(root / name, *TINY, *SAVING, "--resume", "auto")
    yield jobs, info
    kill_all(jobs)


SAVING = ["--save-every", "1"]  # a save in the background after every step: one is in flight most of the time


def signal_mid_save(job: Job, signum: int, timeout=300) -> list[str]:
    """Sends ``signum`` once a step checkpoint after step 20 is being written (its .tmp- folder seen); returns the
    unfinished folders seen then."""
    ckpt, deadline = job.out_dir / "checkpoints", time.monotonic() + timeout
    while not ((ckpt / "step-000020").exists() and (in_flight := sorted(p.name for p in ckpt.glob(".tmp-step-*")))):
        assert job.proc.poll() is None, f"the run ended before a save was seen in flight\n{job.output()[-3000:]}"
        assert time.monotonic() < deadline, "no save seen in flight"
        time.sleep(0.001)
    job.proc.send_signal(signum)
    return in_flight


def test_sigkill_during_a_background_save_resumes_from_the_checkpoint_before(runs):
    """kill -9 while a checkpoint is written in the background: the unfinished one is skipped, the run resumes from
    the newest whole one and ends as the uninterrupted run."""
    jobs, info = runs
    assert info["killed_saving_rc"] == -signal.SIGKILL
    whole = [name for name in info["killed_saving_left"] if name.startswith("step-")]
    resumed = jobs["killed_saving_resume"].results()
    assert resumed_step(jobs["killed_saving_resume"].output()) == int(whole[-1].removeprefix("step-"))
    unfinished = [name for name in info["killed_saving_left"] if name.startswith(".tmp-step-")]
    assert all(name.removeprefix(".tmp-") > whole[-1] for name in unfinished)  # what the kill cut short: newer
    full = jobs["full"].results()
    for key in COMPARED:
        assert resumed[key] == pytest.approx(full[key], abs=1e-4), key


def test_sigterm_during_a_background_save_completes_it_exits_75_and_resumes_exactly(runs):
    jobs, info = runs
    out = info["termed_saving_output"]
    assert info["termed_saving_rc"] == EXIT_PREEMPTED, out[-3000:]
    step = int(re.search(r"preempted: saved a checkpoint at step (\d+)", out).group(1))
    assert info["termed_saving_in_flight"][0].removeprefix(".tmp-") <= f"step-{step:06d}"
    assert f"step-{step:06d}" in info["termed_saving_left"]
    assert not [name for name in info["termed_saving_left"] if name.startswith(".")], info["termed_saving_left"]
    resumed = jobs["termed_saving_resume"].results()
    assert resumed_step(jobs["termed_saving_resume"].output()) == step
    full = jobs["full"].results()
    for key in COMPARED:
        assert resumed[key] == pytest.approx(full[key], abs=1e-4), key


def test_sigkill_mid_epoch_then_resume_auto_matches_uninterrupted(runs):
    jobs, info = runs
    assert info["killed_rc"] == -signal.SIGKILL
    assert not info["killed_results"], "the run finished before it was killed"
    resumed = jobs["killed_resume"].results()
    step = resumed_step(jobs["killed_resume"].output())
    assert 0 < step < MAX_STEPS and step % STEPS_PER_EPOCH, f"resumed at step {step}: not inside an epoch"
    full = jobs["full"].results()
    assert resumed["steps"] == full["steps"] == MAX_STEPS
    for key in COMPARED:
        assert resumed[key] == pytest.approx(full[key], abs=1e-4), key
    # the whole run's logged losses, which the stuck-at-chance check reads at the end, not only the resumed part
    assert logged_losses(jobs["killed_resume"]) == pytest.approx(logged_losses(jobs["full"]), abs=1e-4)


def test_a_resume_from_the_folder_refuses_a_flag_that_changes_the_run(runs):
    """The resume above was given only --out-dir and --resume auto; a flag given now that the run did not have is
    refused in one line naming it, and the finished run is left as it was."""
    jobs, _ = runs
    jobs["killed_resume"].results()
    out_dir = jobs["killed_resume"].out_dir
    before = (out_dir / "results.json").read_bytes()
    done = run([sys.executable, "train.py", "--out-dir", str(out_dir), "--resume", "auto", "--lr", "0.5"], check=False)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr[-3000:]
    assert "was written with --lr 0.004 (now 0.5)" in done.stderr
    assert (out_dir / "results.json").read_bytes() == before


def test_a_resume_of_a_finished_run_keeps_its_model_and_results(runs):
    """A finished run keeps no checkpoints/best (model/ holds its weights): resumed, it has no step left to take and
    leaves model/ and results.json as they were."""
    jobs, _ = runs
    jobs["killed_resume"].results()
    out_dir = jobs["killed_resume"].out_dir
    kept = ("results.json", "model/model.safetensors")
    before = [(out_dir / name).read_bytes() for name in kept]
    done = run([sys.executable, "train.py", "--out-dir", str(out_dir), "--resume", "auto"], check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"the best model is still {out_dir}/model" in done.stdout, done.stdout[-3000:]
    assert [(out_dir / name).read_bytes() for name in kept] == before


def test_a_resume_with_neither_best_nor_results_is_one_line(runs, tmp_path):
    """A finished run whose results.json was deleted since has no model left to test: one line, not a damaged
    checkpoint's."""
    jobs, _ = runs
    jobs["killed_resume"].results()
    out_dir = shutil.copytree(jobs["killed_resume"].out_dir, tmp_path / "run")
    (out_dir / "results.json").unlink()
    done = run([sys.executable, "train.py", "--out-dir", str(out_dir), "--resume", "auto"], check=False)
    assert done.returncode == 2 and done.stderr.splitlines()[-1] == (
        f"error: {out_dir}/checkpoints/best is gone (a finished run removes it: model/ holds its weights) and so is "
        f"{out_dir}/results.json: nothing is left to test; start a new --out-dir (or keep it next time with "
        f"--keep-best-checkpoint)"), done.stderr[-3000:]


def logged_losses(job: Job) -> list[float]:
    final = job.out_dir / "checkpoints" / f"step-{MAX_STEPS:06d}" / "state"
    losses = torch.load(final, weights_only=True)["train_losses"]
    assert len(losses) == MAX_STEPS // 5  # --log-every 5
    return losses


def test_resume_auto_skips_partial_and_damaged_checkpoints(runs):
    """The resume above ran with a .tmp- folder and incomplete step folders newer than any real checkpoint: it
    resumed from a real one (and so matched the uninterrupted run)."""
    jobs, info = runs
    jobs["killed_resume"].results()
    step = resumed_step(jobs["killed_resume"].output())
    assert f"step-{step:06d}" in info["killed_steps"]
    assert step < 96


def test_keep_last_prunes_older_step_checkpoints(runs):
    jobs, _ = runs
    jobs["full"].results()
    assert step_dirs(jobs["full"].out_dir) == ["step-000090", "step-000100"]  # --keep-last 2 (the default)
    assert not (jobs["full"].out_dir / "checkpoints" / "best").exists()  # model/ holds its weights
    assert not list((jobs["full"].out_dir / "checkpoints").glob(".*")), "temporary folders were left behind"


def test_sigterm_saves_a_checkpoint_and_exits_75_then_resume_completes(runs):
    jobs, info = runs
    out = info["termed_output"]
    assert info["termed_rc"] == EXIT_PREEMPTED, out[-3000:]
    stopped = re.search(r"preempted: saved a checkpoint at step (\d+); rerun with --resume auto", out)
    assert stopped, out[-3000:]
    step = int(stopped.group(1))
    assert 20 <= step < MAX_STEPS
    assert f"step-{step:06d}" in info["termed_steps"]
    assert "Traceback" not in out
    losses = logged(jobs["termed"].out_dir, "train/loss", version=0)  # the stopped segment's log
    assert losses and max(losses) >= step - 5, losses  # logged every 5 steps, up to where it stopped
    resumed = jobs["termed_resume"].results()
    assert resumed_step(jobs["termed_resume"].output()) == step
    for name in ("preempted.txt", ".lock"):  # the run completed: neither says anything true any more
        assert not (jobs["termed"].out_dir / name).exists(), name
    full = jobs["full"].results()
    for key in COMPARED:  # a preempted run loses nothing either
        assert resumed[key] == pytest.approx(full[key], abs=1e-4), key


def test_non_finite_loss_stops_with_one_line_naming_the_step(runs):
    jobs, _ = runs
    job = jobs["nonfinite"]
    rc = job.wait()
    out = job.output()
    assert rc not in (0, EXIT_PREEMPTED), out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-3000:]
    assert re.search(r"training loss became (nan|inf|-inf) by step \d+", errors[0]), errors[0]
    assert "--lr" in errors[0]
    assert "Traceback" not in out
    assert not (job.out_dir / "results.json").exists()


EXPORT_CHECK = r"""
import json, sys
import datasets, torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

model_dir, data_file = sys.argv[1], sys.argv[2]
n = int(sys.argv[3]) if len(sys.argv) > 3 else 64  # the run's --test-size
model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
tokenizer = AutoTokenizer.from_pretrained(model_dir)
test = datasets.load_dataset("parquet", data_files={"test": data_file})["test"]
rows = test.shuffle(seed=123).select(range(n))  # the run's --test-size subset (seeded as data/sources.py does)
label2id = {v: k for k, v in model.config.id2label.items()}
correct = 0
with torch.no_grad():
    for s in range(0, n, 16):
        batch = rows[s:s + 16]
        enc = tokenizer(batch["text"], truncation=True, max_length=128, padding=True, return_tensors="pt")
        predicted = model(**enc).logits.argmax(-1).tolist()
        correct += sum(p == label2id[label] for p, label in zip(predicted, batch["label"]))
print(json.dumps({"id2label": {str(k): v for k, v in model.config.id2label.items()}, "acc": correct / n}))
"""


def test_exported_model_loads_with_from_pretrained_and_predicts(runs):
    jobs, _ = runs
    full = jobs["full"].results()
    data_file = Path.home() / ".cache" / "fabric-template" / "demo" / "data" / "test.parquet"
    env = {k: v for k, v in subprocess_env().items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", EXPORT_CHECK, str(jobs["full"].out_dir / "model"), str(data_file)],
                          cwd=jobs["full"].out_dir, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["id2label"] == {"0": "negative", "1": "positive"}
    assert found["acc"] >= 0.75, found  # chance is 0.5
    # the export is the best checkpoint that scored results.json's test accuracy (one row of slack for padding)
    assert abs(found["acc"] - full["test_acc"]) <= 1 / 64 + 1e-6, (found, full["test_acc"])


def test_sigterm_to_the_launcher_of_two_cpu_processes(tmp_path):
    """``--devices 2`` on the CPU (DDP over gloo): SIGTERM reaches only the launcher (rank 0); the ranks agree at the
    next check, both save, every process exits and the launcher's status is 75; --resume auto then finishes."""
    out = tmp_path / "ddp"
    ddp = ["--devices", "2", "--strategy", "ddp", "--save-every", "5", "--max-steps", "20"]
    job = Job(out, *TINY, *ddp)
    job.wait_for(out / "checkpoints" / "step-000005")
    job.proc.send_signal(signal.SIGTERM)  # the launcher only, not its process group
    rc = job.wait()
    job.wait_group()
    output = job.output()
    assert rc == EXIT_PREEMPTED, output[-5000:]
    stopped = re.search(r"preempted: saved a checkpoint at step (\d+)", output)
    assert stopped, output[-3000:]
    step = int(stopped.group(1))
    assert (out / "checkpoints" / f"step-{step:06d}" / "rng-rank1.pt").is_file()
    resumed = Job(out, *TINY, *ddp, "--resume", "auto")
    results = resumed.results()
    resumed.wait_group()
    assert resumed_step(resumed.output()) == step
    assert results["world_size"] == 2 and results["steps"] == 20


def test_find_resume_checkpoint_trusts_only_complete_folders(tmp_path):
    """The rules behind --resume auto, without a run: newest complete step folder wins; a ``best`` whose
    replacement was interrupted between its two renames is put back."""
    from fabric_utils.checkpoint import step_checkpoints
    from fabric_utils.resume import find_resume_checkpoint

    ckpt = tmp_path / "checkpoints"
    for name in ("step-000005", "step-000010", ".old-best"):
        (ckpt / name).mkdir(parents=True)
        (ckpt / name / "state").write_bytes(b"x")
        (ckpt / name / "rng-rank0.pt").write_bytes(b"x")
        (ckpt / name / "record.json").write_text('{"world_size": 1, "fingerprint": null}')
        write_manifest(ckpt / name)
    plant_damaged_checkpoints(ckpt)
    said = []
    assert find_resume_checkpoint("auto", ckpt, report=said.append) == ckpt / "step-000010"
    assert [line.split(": ", 1)[1] for line in said] == [
        "its manifest.json is missing or cannot be read", "state has 0 bytes, not the 7 written",
        "rng-rank0.pt is missing"]
    assert [p.name for p in step_checkpoints(ckpt)] == ["step-000005", "step-000010"]
    assert (ckpt / "best" / "state").is_file() and not (ckpt / ".old-best").exists()
    assert find_resume_checkpoint(None, ckpt) is None
    assert find_resume_checkpoint("auto", tmp_path / "none") is None


def test_checkpoint_fingerprint_accepts_another_spelling_of_the_same_model_folder(tmp_path, monkeypatch):
    from fabric_utils.resume import _check_fingerprint
    from fabric_utils.errors import UserError

    (tmp_path / "model").mkdir()
    monkeypatch.chdir(tmp_path)
    labels = ["negative", "positive"]
    _check_fingerprint(tmp_path, {"model": "model", "labels": labels},
                       {"model": str(tmp_path / "model"), "labels": labels})
    with pytest.raises(UserError, match="was written with model"):
        _check_fingerprint(tmp_path, {"model": "model", "labels": labels}, {"model": "other", "labels": labels})
    with pytest.raises(UserError, match="was written with labels"):
        _check_fingerprint(tmp_path, {"model": "model", "labels": labels}, {"model": "./model", "labels": ["a", "b"]})
    with pytest.raises(UserError, match=r"was written with problem_type multi_label \(now single_label\)"):
        _check_fingerprint(tmp_path, {"model": "model", "labels": labels, "problem_type": "multi_label"},
                    {"model": "./model", "labels": labels, "problem_type": "single_label"})
