"""Bad input: every mistake a user can make in flags, data, model, checkpoint or output folder ends the run
with a non-zero status and one ``error: ...`` line on stderr that says what to change; no traceback, and nothing
already in --out-dir is touched.

Importing train.py's dependencies takes longer than most of these runs need to fail, so each case runs forked from a
process that imported them once (tests/conftest.py); one case also runs in a fresh interpreter, which checks that a
forked run reports what a real one does."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import REPO, digest, fabric_cli, forkable, popen, run, shimmed, subprocess_env
from data.demo import make_review, prepare_demo
from fabric_utils.args import RUN_MARKER
from fabric_utils.checkpoint import write_manifest

ROOT = REPO
DEMO = Path.home() / ".cache" / "fabric-template" / "demo"
MODEL = str(DEMO / "model")  # the demo's model: a 2-label BertForSequenceClassification
QUICK = ["--accelerator", "cpu", "--precision", "32-true", "--num-workers", "0", "--max-length", "32", "--epochs", "1",
         "--batch-size", "8", "--quiet"]

# flags whose values, written out, need gigabytes: a YAML alias bomb (9 lists of 9 of the one before)
ALIAS_BOMB = "lr: 0.001\ntext_column: [" + ", ".join(f"&k{i} [{', '.join([f'*k{i - 1}' if i else '1'] * 9)}]"
                                                      for i in range(9)) + "]\n"


def write_reviews(path: Path, rows: int, seed: int, labels=("negative", "positive"), columns=("text", "label")):
    rng = random.Random(seed)
    reviews = []
    for _ in range(rows):
        text, label = make_review(rng)
        reviews.append((text, labels[rng.randrange(len(labels))] if len(labels) != 2 else
                        labels[("negative", "positive").index(label)]))
    pd.DataFrame(reviews, columns=list(columns)).to_csv(path, index=False)
    return path


def data_folder(path: Path, labels=("negative", "positive")) -> Path:
    path.mkdir()
    for i, (split, rows) in enumerate((("train", 40), ("validation", 8), ("test", 8))):
        write_reviews(path / f"{split}.csv", rows, seed=i, labels=labels)
    return path


def write_other_model(folder: Path) -> None:
    """The demo's tokenizer with a 32-wide BERT: another model with the demo's labels."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    BertForSequenceClassification(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=64, num_labels=2)
                                  ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def build_cases(tmp: Path) -> tuple[list, dict]:
    """(cases, facts): each case has an id, train.py arguments, the exit status, the text its error line must hold,
    and whether it runs in a fresh interpreter."""
    prepare_demo(DEMO)
    ok = data_folder(tmp / "data_ok")
    other_labels = data_folder(tmp / "data_other_labels", labels=("bad", "good"))
    three = data_folder(tmp / "data_three", labels=("a", "b", "c"))
    write_reviews(tmp / "small.csv", 50, 0)  # one file: validation and test are carved from its rows
    write_reviews(tmp / "no_text.csv", 30, 0, columns=("review", "label"))
    write_reviews(tmp / "no_label.csv", 30, 0, columns=("text", "sentiment"))
    pd.DataFrame({"text": ["good film"] * 15 + ["bad film"] * 15, "label": [1] * 15 + [-1] * 15}).to_csv(
        tmp / "negative.csv", index=False)
    (tmp / "empty.csv").write_bytes(b"")
    (tmp / "header_only.csv").write_text("text,label\n")
    (tmp / "unquoted_comma.csv").write_text("text,label\ngood film,1\nslow, dull film,0\n")
    (tmp / "garbage.parquet").write_bytes(b"this is not parquet\n" * 10)
    (tmp / "a_file").write_text("not a folder\n")
    other_model = tmp / "other_model"  # another model with the same labels
    good_out = tmp / "good_run"
    good_ckpt = good_out / "checkpoints" / "step-000002"
    # the good run's checkpoint (its record, so the resume gets as far as loading) with damage its manifest cannot
    # see (rewritten since, as a hand can): a state file of random bytes, a damaged RNG file
    corrupt, bad_rng = tmp / "corrupt" / "step-000002", tmp / "bad_rng" / "step-000002"
    for damaged in (corrupt, bad_rng):
        damaged.mkdir(parents=True)
        (damaged / "rng-rank0.pt").write_bytes(b"garbage")
    (corrupt / "state").write_bytes(random.Random(2).randbytes(4096))  # bytes that unpickle to an IndexError
    (corrupt / "record.json").write_text('{"world_size": 1, "fingerprint": null}')  # as written: the state is not
    write_manifest(corrupt)
    prepare = {"corrupt_rng_file": {"copy": [[str(good_ckpt / name), str(bad_rng / name)]
                                             for name in ("state", "record.json")], "manifest": str(bad_rng)}}

    user_files = tmp / "user_files"  # what a user keeps where a run could write the same names
    (user_files / "model").mkdir(parents=True)
    (user_files / "notes.txt").write_text("mine\n")
    (user_files / "loss.png").write_bytes(b"my plot")
    (user_files / "model" / "config.json").write_text('{"mine": true}\n')
    user_run_names = tmp / "user_run_names"  # a user's folder holding the names a run writes
    (user_run_names / "logs").mkdir(parents=True)
    (user_run_names / "model").mkdir()
    (user_run_names / "config.yaml").write_text("notes: mine\n")
    (user_run_names / "logs" / "day1.csv").write_text("a,b\n1,2\n")
    (user_run_names / "model" / "my_weights.bin").write_bytes(b"weights")
    (user_run_names / "notes.txt").write_text("mine\n")
    bomb_run = tmp / "bomb_run"  # a run's folder whose config.yaml is a YAML alias bomb with valid keys
    bomb_run.mkdir()
    (bomb_run / RUN_MARKER).write_text("")
    (bomb_run / "results.json").write_text("{}")
    (bomb_run / "config.yaml").write_text(ALIAS_BOMB)

    bad_config, not_yaml = tmp / "bad.yaml", tmp / "not.yaml"
    bad_config.write_text("lr: -1.0\n")  # a value the flag's own check refuses
    not_yaml.write_text("lr: 1\n- 2\n")  # a list item inside a mapping
    data = ["--model", MODEL, "--dataset", str(ok), *QUICK]
    resume = ["--max-steps", "2"]  # the good run's optimization: a resume that changed it would be refused first
    cases = [
        # a real run first: its checkpoint is resumed below with another label set and another model
        ("good_run", ["--dataset", str(ok), "--model", MODEL, *QUICK, "--max-steps", "2", "--save-every", "2",
                      "--out-dir", str(good_out)], 0, None, False),
        ("unknown_strategy", [*data, "--strategy", "warp_drive"], 2, "argument --strategy: invalid choice", False),
        ("unknown_precision", [*data, "--precision", "8-bit"], 2, "argument --precision: invalid choice", False),
        ("unknown_accelerator", [*data, "--accelerator", "quantum"], 2, "argument --accelerator: invalid choice",
         False),
        ("16_mixed_on_cpu", [*data, "--precision", "16-mixed"], 2, "16-mixed", False),
        # Lightning's advice to write 16 as 16-mixed, which fails the same way, must not come first
        ("precision_16_on_cpu", [*data, "--precision", "16"], 2, "error: --precision 16 needs a CUDA GPU", False),
        ("batch_size_zero", [*data, "--batch-size", "0"], 2, "argument --batch-size: must be a positive integer",
         False),
        ("batch_size_negative", [*data, "--batch-size", "-4"], 2, "argument --batch-size", False),
        ("epochs_zero", [*data, "--epochs", "0"], 2, "argument --epochs: must be a positive integer", False),
        ("max_length_zero", [*data, "--max-length", "0"], 2, "argument --max-length: must be a positive integer",
         False),
        ("lr_negative", [*data, "--lr", "-1"], 2, "argument --lr: must be a positive number", False),
        ("dataset_missing", ["--model", MODEL, *QUICK, "--dataset", str(tmp / "nowhere" / "train.csv")], 2,
         "does not exist (pass an existing file or folder to --dataset)", False),
        ("dataset_empty_file", ["--model", MODEL, *QUICK, "--dataset", str(tmp / "empty.csv")], 2, "is empty",
         False),
        ("dataset_header_only", ["--model", MODEL, *QUICK, "--dataset", str(tmp / "header_only.csv")], 2,
         f"dataset file {tmp / 'header_only.csv'} has no rows", False),
        ("dataset_bad_csv_row", ["--model", MODEL, *QUICK, "--dataset", str(tmp / "unquoted_comma.csv")], 2,
         f"cannot read dataset files ['{tmp / 'unquoted_comma.csv'}'] as csv: Error tokenizing data. C error: "
         f"Expected 2 fields in line 3, saw 3", False),
        ("dataset_not_parquet", ["--model", MODEL, *QUICK, "--dataset", str(tmp / "garbage.parquet")], 2,
         f"cannot read dataset files ['{tmp / 'garbage.parquet'}'] as parquet", False),
        ("no_text_column", ["--model", MODEL, *QUICK, "--dataset", str(tmp / "no_text.csv")], 2,
         "has no column 'text'; its columns are ['review', 'label'] (set --text-column", False),
        ("no_label_column", ["--model", MODEL, *QUICK, "--dataset", str(tmp / "no_label.csv")], 2,
         "has no column 'label'; its columns are ['text', 'sentiment'] (set --text-column / --label-column)", False),
        ("negative_labels", ["--model", MODEL, *QUICK, "--dataset", str(tmp / "negative.csv")], 2,
         "negative labels [-1]", True),
        ("more_labels_than_the_model", ["--model", MODEL, *QUICK, "--dataset", str(three)], 2,
         "classifies 2 labels", False),
        ("model_missing", ["--dataset", str(ok), *QUICK, "--model", str(tmp / "no_model")], 2,
         "does not exist (pass a hub id or an existing folder to --model)", False),
        ("resume_missing", [*data, "--resume", str(tmp / "no_checkpoint")], 2, "is not a checkpoint folder", False),
        ("corrupt_checkpoint", [*data, *resume, "--resume", str(corrupt)], 2,
         f"cannot restore checkpoint {corrupt}: its state is damaged or was not written by train.py", False),
        ("corrupt_rng_file", [*data, *resume, "--resume", str(bad_rng)], 2,
         f"cannot restore checkpoint {bad_rng}: its rng-rank0.pt is damaged", False),
        ("checkpoint_other_labels", ["--model", MODEL, "--dataset", str(other_labels), *QUICK, *resume,
                                     "--resume", str(good_ckpt)], 2,
         "labels ['negative', 'positive'] (now ['bad', 'good'])", False),
        ("checkpoint_other_model", ["--model", str(other_model), "--dataset", str(ok), *QUICK, *resume,
                                    "--resume", str(good_ckpt)], 2, f"was written with model {MODEL} (now", False),
        ("out_dir_under_a_file", [*data, "--out-dir", str(tmp / "a_file" / "run")], 2,
         "cannot write to output folder", False),
        ("config_value_checked", [*data, "--config", str(bad_config)], 2,
         f"config file {bad_config}: argument --lr: must be a positive number, got -1.0", False),
        ("config_not_yaml", [*data, "--config", str(not_yaml)], 2, f"config file {not_yaml} line 2: not valid YAML",
         False),
        ("devices_beyond_the_cores", [*data, "--accelerator", "cpu", "--devices", "64"], 2,
         "--devices 64: 64 CPU processes on", False),
        ("out_dir_holds_a_run", [*data], 2, "holds a run already; continue it with --resume auto, or pass a new "
         "--out-dir", False),
        ("out_dir_holds_user_run_names", [*data, "--out-dir", str(user_run_names)], 2,
         f"--out-dir {user_run_names} holds files that are not a run's (config.yaml, logs, model, ...); pass a new or "
         f"empty --out-dir", False),
        ("resume_into_user_run_names", [*data, "--resume", "auto", "--out-dir", str(user_run_names)], 2,
         f"--out-dir {user_run_names} holds files that are not a run's (config.yaml, logs, model, ...)", False),
        ("resume_alias_bomb", [*data, "--resume", "auto", "--out-dir", str(bomb_run)], 2,
         f"config file {bomb_run / 'config.yaml'} line 2: not valid YAML (an anchor or alias (& or *); write each "
         f"value out)", False),
        ("out_dir_holds_user_files", [*data, "--out-dir", str(user_files)], 2,
         f"--out-dir {user_files} holds files that are not a run's (loss.png, model, notes.txt); pass a new or empty "
         f"--out-dir", False),
        ("resume_into_user_files", [*data, "--resume", "auto", "--out-dir", str(user_files)], 2,
         f"--out-dir {user_files} holds files that are not a run's", False),
        ("diverges_before_its_first_checkpoint", [*data, "--lr", "1e6", "--grad-clip", "0", "--log-every", "1"], 2,
         "the training loss became", False),
        ("val_size_beyond_what_is_carved", ["--model", MODEL, *QUICK, "--dataset", str(tmp / "small.csv"),
                                            "--val-size", "5000"], 2,
         "--val-size 5000: the dataset has no validation split, and a fifth of its 50 training rows, 10, is the most "
         "carved for one; pass --val-size 10 or less", False),
        ("test_size_beyond_the_split", [*data, "--test-size", "50"], 2,
         "--test-size 50: the test split has 8 rows; pass 8 or less", False),
        ("deepspeed_on_cpu", [*data, "--devices", "2", "--strategy", "deepspeed_stage_2"], 2,
         "--strategy deepspeed_stage_2 needs CUDA GPUs (DeepSpeed); on a CPU use --strategy ddp, fsdp2 or auto", False),
        # not a mistake that stops the run: said in one line, and the run goes on with what a batch can hold
        ("batch_size_beyond_the_split", [*data, "--batch-size", "100", "--max-steps", "1"], 0, None, False),
    ]
    built = []
    for case_id, args, rc, message, real in cases:
        if "--out-dir" not in args:
            out = tmp / "runs" / case_id
            args = [*args, "--out-dir", str(out)]
            if "--resume" in args or case_id == "out_dir_holds_a_run":  # a finished run, which must stay as it is
                (out / "model").mkdir(parents=True)
                (out / RUN_MARKER).write_text("")
                (out / "results.json").write_text(json.dumps({"test_acc": 0.875, "case": case_id}, indent=2))
                (out / "model" / "config.json").write_text("{}\n")
        built.append({"id": case_id, "args": args, "rc": rc, "message": message, "real": real,
                      **prepare.get(case_id, {})})
    return built, {"good_ckpt": good_ckpt, "other_model": str(other_model)}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_input")
    cases, facts = build_cases(tmp)
    before = {c["id"]: digest(Path(c["args"][c["args"].index("--out-dir") + 1])) for c in cases
              if c["id"] != "good_run" and Path(c["args"][c["args"].index("--out-dir") + 1]).is_dir()}
    real = {c["id"]: subprocess.Popen([sys.executable, "train.py", *c["args"]], cwd=ROOT, env=subprocess_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for c in cases if c["real"]}
    write_other_model(Path(facts["other_model"]))
    results = {}
    for case in cases:
        if case["real"]:
            continue
        for source, dest in case.get("copy", []):  # a checkpoint made from what the cases before it wrote
            shutil.copy(source, dest)
        if "manifest" in case:
            write_manifest(Path(case["manifest"]))
        done = run([sys.executable, "train.py", *case["args"]], timeout=240, check=False)
        results[case["id"]] = {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
    for case_id, proc in real.items():
        stdout, stderr = proc.communicate(timeout=300)
        results[case_id] = {"rc": proc.returncode, "stdout": stdout, "stderr": stderr}
    (tmp / "outcomes.json").write_text(json.dumps(results, indent=1))
    return {c["id"]: c for c in cases}, results, before, facts


CASE_IDS = ["unknown_strategy", "unknown_precision", "unknown_accelerator", "16_mixed_on_cpu", "batch_size_zero",
            "batch_size_negative", "epochs_zero", "max_length_zero", "lr_negative", "dataset_missing",
            "dataset_empty_file", "dataset_header_only", "dataset_bad_csv_row",
            "dataset_not_parquet", "no_text_column", "no_label_column", "negative_labels",
            "more_labels_than_the_model", "model_missing", "resume_missing", "corrupt_checkpoint", "corrupt_rng_file",
            "checkpoint_other_labels", "checkpoint_other_model", "out_dir_under_a_file", "config_value_checked",
            "config_not_yaml", "devices_beyond_the_cores", "out_dir_holds_a_run", "val_size_beyond_what_is_carved",
            "test_size_beyond_the_split", "deepspeed_on_cpu", "out_dir_holds_user_files", "resume_into_user_files",
            "diverges_before_its_first_checkpoint",
            "precision_16_on_cpu", "out_dir_holds_user_run_names", "resume_into_user_run_names", "resume_alias_bomb"]


def test_the_good_run_works(outcomes):
    """Sanity check of the harness and of the checkpoint the label-set and model cases resume."""
    cases, results, _, facts = outcomes
    assert set(cases) == {"good_run", "batch_size_beyond_the_split", *CASE_IDS}  # each built case is checked
    result = results["good_run"]
    assert result["rc"] == 0, result["stderr"][-5000:]
    assert (facts["good_ckpt"] / "state").is_file()
    recorded = torch.load(facts["good_ckpt"] / "state", weights_only=True, mmap=True)["fingerprint"]
    assert {k: recorded[k] for k in ("model", "labels", "problem_type", "optimizer steps (--max-steps, --epochs)")} == {
        "model": MODEL, "labels": ["negative", "positive"], "problem_type": "single_label",
        "optimizer steps (--max-steps, --epochs)": 2}


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_bad_input_fails_with_one_error_line_and_touches_nothing(outcomes, case_id):
    cases, results, before, facts = outcomes
    case, result = cases[case_id], results[case_id]
    stderr = result["stderr"]
    assert result["rc"] == case["rc"], f"exit {result['rc']}\n{stderr[-5000:]}"
    assert "Traceback" not in stderr and "Traceback" not in result["stdout"], stderr[-5000:]
    assert stderr.splitlines() == [f"error: {stderr.split('error: ', 1)[-1].strip()}"], stderr[-5000:]  # one line
    assert case["message"] in stderr, stderr
    out_dir = Path(case["args"][case["args"].index("--out-dir") + 1])
    if case_id in before:
        after = digest(out_dir)
        for name, sha in before[case_id].items():  # results.json and the exported model stay byte-identical
            assert after.get(name) == sha, f"{name} in --out-dir was changed or removed"
        assert after == before[case_id], "a file was added to --out-dir"
        assert not (out_dir / "checkpoints").exists()
    else:  # a start that failed leaves no folder behind
        assert not out_dir.exists(), sorted(out_dir.rglob("*"))
    if case_id.startswith("checkpoint_"):
        assert (facts["good_ckpt"] / "state").is_file()


def test_a_batch_size_beyond_the_training_rows_is_said_and_what_is_used_recorded(outcomes):
    cases, results, _, _ = outcomes
    result = results["batch_size_beyond_the_split"]
    assert result["rc"] == 0 and not result["stderr"], result["stderr"][-3000:]
    assert "--batch-size 100 is more than the 40 training rows per device: using 40" in result["stdout"].splitlines()
    args = cases["batch_size_beyond_the_split"]["args"]
    run_dir = Path(args[args.index("--out-dir") + 1])
    assert json.loads((run_dir / "results.json").read_text())["config"]["batch_size"] == 40


@pytest.mark.parametrize("flags, message", [
    (["--text-colum", "review"], "unknown flag --text-colum (did you mean --text-column?)"),  # not a prefix match
    (["--lable-column=stars", "--epoch", "2"], "unknown flags --lable-column (did you mean --label-column?), --epoch "
                                               "(did you mean --epochs?)"),
    (["--zzz"], "unknown flag --zzz"),
], ids=["prefix", "misspelt", "nothing_close"])
def test_an_unknown_flag_is_one_line_naming_the_closest(tmp_path, flags, message):
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "train.py", "--demo", *flags, "--out-dir", str(out)], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and not done.stdout and not out.exists()
    assert done.stderr == f"error: {message}; --help lists every flag\n"


@pytest.mark.parametrize("flags", [["--help"], ["--warmup", "-0.5"]], ids=["help", "bad_value"])
def test_help_and_a_bad_flag_answer_at_once(flags):
    """The flags are checked before torch, Lightning and transformers load (seconds): the usage block for --help,
    one line for a bad value."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "train.py", *flags], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=60)
    seconds = time.monotonic() - start
    assert seconds < 2, f"{flags} took {seconds:.1f} s"
    if flags == ["--help"]:
        assert done.returncode == 0 and "--strategy" in done.stdout and not done.stderr
    else:
        assert done.returncode == 2 and not done.stdout
        assert done.stderr == "error: argument --warmup: must be zero or positive, got -0.5\n"


@pytest.mark.parametrize("env", [{}, shimmed(FABRIC_TEMPLATE_DEEPSPEED_CPU="1")], ids=["plain", "shimmed"])
def test_a_forked_run_reports_what_a_fresh_interpreter_does(tmp_path, monkeypatch, env):
    """The tests' runs are forked from a process that imported train.py's libraries under the run's environment
    (tests/conftest.py): a run that stops after its imports gives the same status and output as ``python train.py``
    does."""
    command = [sys.executable, "train.py", "--model", MODEL, *QUICK, "--dataset", str(tmp_path / "nowhere.csv"),
               "--out-dir", str(tmp_path / "run")]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert forkable(command)
    forked = run(command, check=False)
    monkeypatch.setenv("FABRIC_TEMPLATE_TESTS_FRESH", "1")
    fresh = run(command, check=False)
    assert fresh.returncode == 2 and "does not exist" in fresh.stderr, fresh.stderr[-3000:]
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "no_network"])
def test_a_hub_model_not_on_this_machine_stops_at_once_naming_model_path(tmp_path, offline):
    """A hub id in no local cache, offline or with no network (the hub's address refuses connections): one line
    naming --model PATH within 10 s of the run's start, not after the hub client's minute of retries. Timed forked
    (the run's imports done), after a first run that started the forkserver."""
    env = subprocess_env()
    if not offline:
        del env["HF_HUB_OFFLINE"]
        env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # the discard port, where nothing listens
    dataset = write_reviews(tmp_path / "my.csv", 40, seed=0)
    assert popen([sys.executable, "train.py", "--help"], env, tmp_path / "help.log").wait(timeout=300) == 0
    start = time.monotonic()
    stopped = popen([sys.executable, "train.py", "--dataset", str(dataset), "--model", "fabric-template/not-here",
                     *QUICK, "--out-dir", str(tmp_path / "run")], env, tmp_path / "run.log").wait(timeout=120)
    seconds = time.monotonic() - start
    output = (tmp_path / "run.log").read_text()
    assert stopped == 2 and output.splitlines()[-1].startswith("error: model fabric-template/not-here is not on this "
                                                               "machine"), output[-3000:]
    assert output.splitlines()[-1].endswith(": pass --model PATH, a local model folder") and "Retrying" not in output
    assert seconds < 10, f"{seconds:.1f} s"
    assert not (tmp_path / "run").exists()


def test_predict_on_a_folder_that_holds_no_run_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "predict.py", str(tmp_path), str(tmp_path / "rows.csv")], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and not done.stdout and done.stderr.splitlines() == [
        f"error: {tmp_path / 'model'} does not exist: pass the folder of a run that finished (it exports model/)"]


def run_job(command: list, out_dir: Path) -> subprocess.CompletedProcess:
    """Runs ``command`` in its own process group and checks that every process of the job has ended with it."""
    proc = subprocess.Popen(command, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    stdout, stderr = proc.communicate(timeout=300)
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        pass
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"processes of {command} still ran when it returned\n{stderr[-3000:]}")
    assert not out_dir.exists(), sorted(out_dir.rglob("*"))
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def test_deepspeed_on_cpu_stops_before_any_process_starts(tmp_path):
    out = tmp_path / "run"
    done = run_job([sys.executable, "train.py", "--demo", *QUICK, "--devices", "2", "--strategy", "deepspeed_stage_2",
                    "--out-dir", str(out)], out)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "error: --strategy deepspeed_stage_2 needs CUDA GPUs (DeepSpeed); on a CPU use --strategy ddp, fsdp2 or auto"]


def test_a_setting_fabric_run_took_twice_is_said(tmp_path):
    """`fabric run` reads its options even after the script's name and takes the last: `--devices 2 train.py ...
    --devices 1` ran one process without a word. Its processes have started when the script can tell, so torchrun's
    own report of a failed worker follows the line: it names the line as the root cause."""
    out, port = tmp_path / "run", str(29500 + os.getpid() % 1000)  # not torchrun's default: other jobs may hold it
    done = run_job([fabric_cli(), "run", "--main-port", port, "--accelerator", "cpu", "--devices", "2", "train.py",
                    "--demo", *QUICK, "--out-dir", str(out), "--devices", "1"], out)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --devices is given to `fabric run` twice (2 and 1), and it took the last (1) even if it "
                      "came after train.py; give --devices once"], done.stderr[-3000:]
    root_cause = done.stderr.split("Root Cause")[-1]
    assert f"traceback : {errors[0]}" in root_cause, done.stderr[-3000:]


@pytest.fixture
def predict_cases(outcomes, tmp_path):
    """predict.py's bad input, beside a copy of the good run's folder (its model, its config.yaml)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "model").symlink_to(outcomes[3]["good_ckpt"].parents[1] / "model")
    (run_dir / "config.yaml").write_text((outcomes[3]["good_ckpt"].parents[1] / "config.yaml").read_text())
    (tmp_path / "rows.csv").write_text("text\ngreat film\n")
    (tmp_path / "blank.csv").write_text("text,id\ngreat film,1\n,2\n   ,3\n")
    (tmp_path / "struct.jsonl").write_text('{"text": {"title": "great film"}}\n')
    (tmp_path / "a_file").write_text("mine\n")
    config = (run_dir / "config.yaml").read_text()
    folders = {"lacking": "lr: 0.001\n", "max_length_text": config.replace("max_length: 32", "max_length: many"),
               "pad_zero": config.replace("pad_to_multiple_of: 8", "pad_to_multiple_of: 0"),
               "text_column_list": config.replace("text_column: text", "text_column: [text, label]"),
               "alias_bomb": ALIAS_BOMB}
    for name, text in folders.items():
        assert text != config, name
        (tmp_path / name).mkdir()
        (tmp_path / name / "model").symlink_to(run_dir / "model")
        (tmp_path / name / "config.yaml").write_text(text)
    backtracks = shutil.copytree(run_dir, tmp_path / "backtracks", symlinks=False)  # a tokenizer regex that
    tokenizer = json.loads((backtracks / "model" / "tokenizer.json").read_text())  # backtracks past onig's limit
    tokenizer["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a|a?)+$"}, "behavior": "Isolated",
                                  "invert": False}
    (backtracks / "model" / "tokenizer.json").write_text(json.dumps(tokenizer))
    (tmp_path / "long.csv").write_text(f"text\n{'a' * 5000}b\n")
    return run_dir, tmp_path


@pytest.mark.parametrize("case, message", [
    ("blank", "2 rows of {tmp}/blank.csv have missing or empty text in column 'text', first at lines 3, 4 of "
              "{tmp}/blank.csv; fill them in or leave them out"),
    ("struct", "column 'text' holds struct<title: string> values, not text: set --text-column to the column with "
               "the text"),
    ("out_in_a_file", "--out {tmp}/a_file/predictions.csv: {tmp}/a_file is not a folder a file can be written "
                      "into; pass a file path in an existing folder"),
    ("lacking", "the run's config.yaml lacks max_length, pad_to_multiple_of, text_column, text_pair_column: pass "
                "the folder of a run train.py wrote"),
    ("max_length_text", "config file {tmp}/max_length_text/config.yaml: argument --max-length: must be a positive "
                        "integer, got many"),
    ("pad_zero", "config file {tmp}/pad_zero/config.yaml: argument --pad-to-multiple-of: must be a positive integer, "
                 "got 0"),
    ("text_column_list", "config file {tmp}/text_column_list/config.yaml: text_column holds a list; it takes one "
                         "value"),
    ("alias_bomb", "config file {tmp}/alias_bomb/config.yaml line 2: not valid YAML (an anchor or alias (& or *); "
                   "write each value out)"),
    ("backtracks", "the tokenizer of {tmp}/backtracks/model failed on the rows of {tmp}/long.csv: Onig: Regex search "
                   "error: retry-limit-in-match over")])
def test_predict_bad_input_is_one_line_and_writes_nothing(predict_cases, tmp_path, capfd, case, message):
    import predict

    run_dir, folders = predict_cases
    rows = tmp_path / ("long.csv" if case == "backtracks" else "rows.csv")
    argv = {"blank": [run_dir, tmp_path / "blank.csv"], "struct": [run_dir, tmp_path / "struct.jsonl"],
            "out_in_a_file": [run_dir, tmp_path / "rows.csv", "--out", tmp_path / "a_file" / "predictions.csv"]
            }.get(case, [folders / case, rows])
    with pytest.raises(SystemExit) as exit_:
        predict.main(list(map(str, argv)))
    assert exit_.value.code == 2
    assert capfd.readouterr().err.splitlines() == [f"error: {message.format(tmp=tmp_path)}"]
    assert not list(tmp_path.rglob("predictions.csv"))
    assert (tmp_path / "a_file").read_text() == "mine\n"
