"""Bad data: bad rows named by split, column, count and place (or dropped with --drop-invalid), and the
three problem types: single_label, multi_label and regression."""

import json
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import run
from data.demo import prepare_demo
from data.sources import load_splits
from data.tokenize import make_collator, tokenize_splits
from fabric_utils.loaders import make_dataloaders
from fabric_utils.errors import UserError
import task

DEMO = Path.home() / ".cache" / "fabric-template" / "demo"
TEXTS = ["a great film", "dull and slow", "quite good", "awful", "fine acting"]


def frame(labels, texts=None) -> pd.DataFrame:
    texts = texts or [TEXTS[i % len(TEXTS)] for i in range(len(labels))]
    return pd.DataFrame({"text": texts, "label": labels})


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def error_of(*args, **kwargs) -> str:
    with pytest.raises(UserError) as err:
        load_splits(*args, **kwargs)
    return str(err.value)


# ---- Part A: bad rows -------------------------------------------------------------------------------------------------

def test_empty_text_names_the_csv_file_lines(tmp_path):
    """The crash that started it: empty cells reached the tokenizer as None ("TextEncodeInput must be ...").
    CSV rows are named by file line, counted the way an editor does, past a quoted cell that spans two lines."""
    path = tmp_path / "reviews.csv"
    path.write_text('text,label\n"a film\nin two lines",1\n,0\ngood,1\n   ,0\n' + "fine,1\nbad,0\n" * 10)
    assert error_of(path) == (
        f"the train split has 2 rows with missing or empty text in column 'text', first at lines 4, 6 of {path}; "
        f"fix the data or pass --drop-invalid to leave such rows out")


def test_missing_labels_name_the_data_rows(tmp_path):
    """Outside CSV, rows are named as data rows counted from 0; integer labels with a gap read as floats."""
    labels = [0, 1] * 10
    labels[3] = labels[7] = None
    path = tmp_path / "r.parquet"
    frame(labels).to_parquet(path)
    assert error_of(path) == (
        f"the train split has 2 rows with missing or empty labels in column 'label', first at rows 3, 7 of {path} "
        f"(counted from 0); fix the data or pass --drop-invalid to leave such rows out")


def test_labels_of_the_wrong_type_are_named_with_examples(tmp_path):
    """Mixed JSON values (ints, a string, a dict) load as one JSON column; the odd ones are named, not crashed on
    (arrow has no unique() for them)."""
    labels = [0, 1, "positive", 1, {"stars": 4}, 0] * 4
    path = write_jsonl([{"text": TEXTS[i % 5], "label": v} for i, v in enumerate(labels)], tmp_path / "r.jsonl")
    assert error_of(path) == (
        f"the train split has 8 rows with labels that are not integer class ids ('positive', {{'stars': 4}}) in "
        f"column 'label', first at rows 2, 4, 8, 10, 14 of {path} (counted from 0); fix the data or pass "
        f"--drop-invalid to leave such rows out")


def test_a_fraction_in_a_single_label_column(tmp_path):
    path = tmp_path / "r.csv"
    frame([0, 1, 0.5, 1] * 5).to_csv(path, index=False)
    assert error_of(path, problem_type="single_label") == (
        f"the train split has 5 rows with labels that are not integer class ids (0.5) in column 'label', first at "
        f"lines 4, 8, 12, 16, 20 of {path}; fix the data or pass --drop-invalid to leave such rows out")


def test_labels_the_train_split_lacks(tmp_path):
    frame(["neg", "pos"] * 10).to_csv(tmp_path / "train.csv", index=False)
    frame(["pos", "neutral", "neg", "mixed"]).to_csv(tmp_path / "validation.csv", index=False)
    assert error_of(tmp_path) == (
        f"the validation split has 2 rows with labels not seen in training ['mixed', 'neutral'] in column 'label', "
        f"first at lines 3, 5 of {tmp_path / 'validation.csv'}; fix the data or pass --drop-invalid to leave such "
        f"rows out")


@pytest.mark.parametrize("data, message", [
    (frame([3, 4, 5, 6], texts=[1, 2, 3, 4]),
     "column 'text' holds int64 values, not text: set --text-column to the column with the text"),
    (frame(["pos"] * 4),  # one output unit would silently turn the model into a regressor
     "the train split has only one label ['pos'] in column 'label': single-label classification needs two or more"),
    (frame([[], []]), "no row of the train split has a label in column 'label'"),
    (frame([True, False]), "cannot tell the problem type from column 'label' of the train split, which holds bool "
                           "values: set --label-column or --problem-type"),
])
def test_columns_that_cannot_train_a_model(tmp_path, data, message):
    path = tmp_path / "r.parquet"
    pd.concat([data] * 5).to_parquet(path)
    assert error_of(path) == message


def test_labels_mixing_class_ids_and_names_are_refused_naming_both(tmp_path):
    """A CSV of 0/1 and pos/neg reads as strings: it used to train as four classes, with exit 0."""
    path = tmp_path / "r.csv"
    frame(["0", "1", "pos", "neg"] * 5).to_csv(path, index=False)
    assert error_of(path) == (
        "column 'label' of the train split mixes integer class ids (0, 1) with class names (neg, pos), which would "
        "train as 4 classes; give every row the same kind of label")


def test_a_file_that_is_not_utf8_says_how_to_resave_it(tmp_path):
    path = tmp_path / "r.csv"
    path.write_bytes("text,label\n".encode() + "".join(f"caf\u00e9 {i},{i % 2}\n" for i in range(20)).encode("latin-1"))
    assert error_of(path) == (
        f"dataset files ['{path}'] are not UTF-8 text (byte e9 is not UTF-8): re-save them as UTF-8, e.g. iconv -f "
        f"cp1252 -t utf-8 FILE > NEW (cp1252 or latin1: what wrote it)")


def test_drop_invalid_counts_each_dropped_row_once_per_split(tmp_path):
    train = frame(["neg", "pos"] * 10)
    train.loc[[2, 5], "text"] = ["", None]
    train.loc[[5, 9], "label"] = None  # row 5 has both problems: counted once, for its text
    train.to_parquet(tmp_path / "train.parquet")
    frame(["pos", "neutral", "neg", None], texts=["good", "so-so", "bad", " "]).to_parquet(
        tmp_path / "validation.parquet")  # the last row lacks both: no "0 with missing labels" in the report
    frame(["neg", "pos"] * 3).to_parquet(tmp_path / "test.parquet")
    data = load_splits(tmp_path, drop_invalid=True)
    assert {name: len(split) for name, split in data.splits.items()} == {"train": 17, "validation": 2, "test": 6}
    assert data.dropped == {"train": {"missing or empty text in column 'text'": 2,
                                      "missing or empty labels in column 'label'": 1},
                            "validation": {"missing or empty text in column 'text'": 1,
                                           "labels not seen in training ['neutral'] in column 'label'": 1}}
    assert data.drop_report() == [
        "--drop-invalid left out 3 rows of the train split: 2 with missing or empty text in column 'text', 1 with "
        "missing or empty labels in column 'label'",
        "--drop-invalid left out 2 rows of the validation split: 1 with missing or empty text in column 'text', "
        "1 with labels not seen in training ['neutral'] in column 'label'"]
    kept = train.drop(index=[2, 5, 9])
    assert data.splits["train"]["text"] == kept["text"].tolist()  # the rows that stay, in order, with their labels
    assert [data.label_names[i] for i in data.splits["train"]["labels"]] == kept["label"].tolist()
    frame(["neutral", None]).to_parquet(tmp_path / "validation.parquet")
    assert error_of(tmp_path, drop_invalid=True) == (
        "--drop-invalid left no rows in the validation split (missing or empty labels in column 'label', labels not "
        "seen in training ['neutral'] in column 'label')")


def test_bad_rows_end_the_run_before_anything_is_written(tmp_path):
    """End to end: exit status 2, one error line, no traceback, no config.yaml or results.json."""
    _, model = prepare_demo(DEMO)
    data = frame([i % 2 for i in range(40)])
    data.loc[[6, 11], "text"] = None
    path = tmp_path / "reviews.csv"
    data.to_csv(path, index=False)
    out = tmp_path / "run"
    result = run([sys.executable, "train.py", "--dataset", str(path), "--model", str(model), "--out-dir", str(out),
                  "--accelerator", "cpu", "--quiet", "--num-workers", "0"], check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert [line for line in result.stderr.splitlines() if "error: " in line] == [
        f"error: the train split has 2 rows with missing or empty text in column 'text', first at lines 8, 13 of "
        f"{path}; fix the data or pass --drop-invalid to leave such rows out"]
    assert not (out / "config.yaml").exists() and not (out / "results.json").exists()


# ---- Part B: problem types ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("labels, problem_type", [
    ([["a", "b"], [], ["c"], ["a"]], "multi_label"),   # a list column
    ([0.5, 1.25, 3.0, 2.0], "regression"),               # numbers with fractions
    ([0.0, 1.0, 2.0, 1.0], "single_label"),              # whole floats: integer labels with a gap read this way
    ([0, 1, 2, 1], "single_label"),
    (["neg", "pos", "neu", "pos"], "single_label"),
])
def test_problem_type_is_detected_from_the_train_labels(tmp_path, labels, problem_type):
    path = tmp_path / "r.parquet"
    frame(labels * 5).to_parquet(path)
    assert load_splits(path).problem_type == problem_type


def test_problem_type_flag_overrides_detection(tmp_path):
    path = tmp_path / "r.parquet"
    frame([0, 1, 5, 3] * 5).to_parquet(path)
    data = load_splits(path, problem_type="regression")
    assert data.problem_type == "regression" and data.label_names == ["label"]
    assert data.splits["train"].features["labels"].dtype == "float32"
    assert sorted(set(data.splits["train"]["labels"])) == [0.0, 1.0, 3.0, 5.0]


def test_multi_label_from_a_list_column(tmp_path):
    labels = [["sad", "angry"], [], ["joy"], ["angry"], ["joy", "sad"]] * 4
    path = tmp_path / "r.parquet"
    frame(labels, texts=[f"text {i}" for i in range(len(labels))]).to_parquet(path)
    data = load_splits(path)
    assert data.problem_type == "multi_label" and data.label_names == ["angry", "joy", "sad"]
    train = data.splits["train"]
    assert train.features["labels"].length == 3 and train.features["labels"].feature.dtype == "float32"
    for text, vector in zip(train["text"], train["labels"]):  # each row keeps its own labels; [] is no label
        expected = labels[int(text.split()[1])]
        assert [name for name, on in zip(data.label_names, vector) if on] == sorted(expected)
        assert sum(vector) == len(expected)


def test_multi_label_from_separated_strings_and_unseen_names(tmp_path):
    frame(["joy|sad", "sad", " angry | joy", "joy"] * 5).to_csv(tmp_path / "train.csv", index=False)
    frame(["joy", "fear|joy", "sad"]).to_csv(tmp_path / "test.csv", index=False)
    assert error_of(tmp_path) == (  # without a separator the strings are single labels, and "fear|joy" is new
        f"the test split has 1 row with labels not seen in training ['fear|joy'] in column 'label', first at line 3 "
        f"of {tmp_path / 'test.csv'}; fix the data or pass --drop-invalid to leave such rows out")
    assert error_of(tmp_path, label_separator="|") == (
        f"the test split has 1 row with labels not seen in training ['fear'] in column 'label', first at line 3 of "
        f"{tmp_path / 'test.csv'}; fix the data or pass --drop-invalid to leave such rows out")
    data = load_splits(tmp_path, label_separator="|", drop_invalid=True)
    assert data.problem_type == "multi_label" and data.label_names == ["angry", "joy", "sad"]
    assert data.splits["test"]["labels"] == [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    assert error_of(tmp_path, problem_type="multi_label") == (
        "column 'label' holds strings, not lists: for --problem-type multi_label set --label-separator (e.g. ',') "
        "or store each row's labels as a list (parquet, JSON lines)")


def test_regression_refuses_words_and_infinities(tmp_path):
    path = tmp_path / "r.csv"
    frame([0.5, 1.5, "n.a.", 2.25, "inf"] * 4).to_csv(path, index=False)  # one word: the column reads as strings
    assert error_of(path, problem_type="regression") == (
        f"the train split has 8 rows with labels that are not numbers ('n.a.', 'inf') in column 'label', first at "
        f"lines 4, 6, 9, 11, 14 of {path}; fix the data or pass --drop-invalid to leave such rows out")
    data = load_splits(path, problem_type="regression", drop_invalid=True)
    assert sorted(set(data.splits["train"]["labels"]) | set(data.splits["test"]["labels"])) == [0.5, 1.5, 2.25]


@pytest.mark.parametrize("labels, problem_type, shape, dtype", [
    ([["joy", "sad"], [], ["angry"], ["joy"]], "multi_label_classification", (8, 3), torch.float32),
    ([0.5, 1.25, 3.0, 2.0], "regression", (8,), torch.float32),
])
def test_tokenized_batches_of_new_label_types_feed_the_model_loss(tmp_path, demo_tokenizer, labels, problem_type,
                                                                   shape, dtype):
    """Tokenizing keeps the label column, the length-grouped sampler and the padding collator stack it into the
    dtype and shape Hugging Face's multi-label (BCE with logits) and regression (MSE) losses take."""
    from transformers import AutoModelForSequenceClassification

    path = tmp_path / "r.parquet"
    frame(labels * 10, texts=[" ".join(["good film"] * (i % 7 + 1)) for i in range(40)]).to_parquet(path)
    data = load_splits(path, seed=0)
    tokenized = tokenize_splits(data.splits, demo_tokenizer, "text", max_length=32)
    loaders = make_dataloaders({name: split.remove_columns("length").with_format("torch")
                                for name, split in tokenized.items()},
                               make_collator(demo_tokenizer, False, 32, 8),
                               {name: split["length"] for name, split in tokenized.items()}, batch_size=8,
                               eval_batch_size=8, world_size=1, rank=0, seed=0, group_by_length=True,
                               num_workers=0, pin_memory=False)
    batch = next(iter(loaders["train"]))
    assert batch["labels"].shape == shape and batch["labels"].dtype == dtype
    model = AutoModelForSequenceClassification.from_pretrained(
        str(DEMO / "model"), num_labels=len(data.label_names), problem_type=problem_type,
        ignore_mismatched_sizes=True)
    model.eval()  # no dropout: the two forwards below must agree
    hf_loss = model(**batch).loss  # transformers' own loss for the problem type
    objective = task.ClassifierObjective(data.problem_type, num_labels=len(data.label_names))
    torch.testing.assert_close(objective.loss(objective.forward(model, batch), batch), hf_loss)  # the template's
