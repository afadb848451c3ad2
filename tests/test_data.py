"""The text task's data: loading, carving, tokenizing and padding."""

import pandas as pd
import pytest

import task
from data.demo import prepare_demo
from data.sources import load_splits
from data.tokenize import make_collator, tokenize_splits
from fabric_utils.errors import UserError
from train import parse_args

REVIEWS = [("a great film", "pos"), ("dull and slow", "neg"), ("quite good", "pos"), ("awful", "neg"),
           ("fine acting", "neutral")] * 20


def write(frame: pd.DataFrame, path):
    {".parquet": frame.to_parquet, ".csv": frame.to_csv,
     ".jsonl": lambda p, index: frame.to_json(p, orient="records", lines=True)}[path.suffix](path, index=False)
    return path


@pytest.mark.parametrize("suffix", [".parquet", ".csv", ".jsonl"])
@pytest.mark.parametrize("string_labels", [True, False])
def test_local_file_with_carved_splits(tmp_path, suffix, string_labels):
    frame = pd.DataFrame(REVIEWS, columns=["review", "sentiment"])
    if not string_labels:
        frame["sentiment"] = frame["sentiment"].map({"neg": 0, "neutral": 1, "pos": 2})
    path = write(frame, tmp_path / f"reviews{suffix}")
    data = load_splits(path, text_column="review", label_column="sentiment", seed=1)
    assert data.label_names == (["neg", "neutral", "pos"] if string_labels else ["0", "1", "2"])
    sizes = {name: len(split) for name, split in data.splits.items()}
    assert sizes == {"train": 60, "validation": 20, "test": 20}  # a fifth of train each, at most 5,000
    again = load_splits(path, text_column="review", label_column="sentiment", seed=1)
    for name in sizes:  # deterministic by seed
        assert data.splits[name]["review"] == again.splits[name]["review"]
    other = load_splits(path, text_column="review", label_column="sentiment", seed=2)
    assert other.splits["test"]["review"] != data.splits["test"]["review"] or len(set(REVIEWS)) < 10
    # labels mapped consistently: each text keeps its own label
    truth = dict(REVIEWS)
    names = data.label_names
    for split in data.splits.values():
        for text, label in zip(split["review"], split["labels"]):
            expected = truth[text] if string_labels else {"neg": 0, "neutral": 1, "pos": 2}[truth[text]]
            assert names[label] == str(expected)


def test_folder_with_splits_and_subsets(tmp_path):
    frame = pd.DataFrame(REVIEWS, columns=["text", "label"])
    write(frame, tmp_path / "train.parquet")
    write(frame.iloc[:30], tmp_path / "test.parquet")
    data = load_splits(tmp_path, seed=0, train_size=50, val_size=7, test_size=11)
    assert {k: len(v) for k, v in data.splits.items()} == {"train": 50, "validation": 7, "test": 11}
    assert set(data.splits["train"].column_names) == {"text", "labels"}


def test_missing_column_lists_the_columns(tmp_path):
    path = write(pd.DataFrame(REVIEWS, columns=["review", "label"]), tmp_path / "r.csv")
    with pytest.raises(UserError, match=r"no column 'text'.*\['review', 'label'\]"):
        load_splits(path)


def test_negative_labels_are_refused(tmp_path):
    path = write(pd.DataFrame({"text": ["a", "b"] * 20, "label": [-1, 0] * 20}), tmp_path / "r.parquet")
    with pytest.raises(UserError, match="negative labels"):
        load_splits(path)


def test_tokenize_is_cached(tmp_path, demo_tokenizer, monkeypatch):
    frame = pd.DataFrame(REVIEWS, columns=["text", "label"])
    data = load_splits(write(frame, tmp_path / "r.parquet"), seed=0)
    first = tokenize_splits(data.splits, demo_tokenizer, "text", max_length=16)
    calls = []
    monkeypatch.setattr(type(demo_tokenizer), "__call__", lambda *a, **k: calls.append(1))
    second = tokenize_splits(data.splits, demo_tokenizer, "text", max_length=16)
    assert calls == []  # read from the cache, not tokenized again
    assert second["train"]["input_ids"] == first["train"]["input_ids"]
    assert max(first["train"]["length"]) <= 16
    assert "text" not in first["train"].column_names


def test_collator_pads_per_batch_or_to_max_length(demo_tokenizer):
    rows = [{"input_ids": [2] + [7] * n + [3], "attention_mask": [1] * (n + 2), "labels": 0} for n in (3, 10)]
    dynamic = make_collator(demo_tokenizer, False, 64, 8)(rows)
    assert dynamic["input_ids"].shape == (2, 16)  # longest row (12) rounded up to a multiple of 8
    article = make_collator(demo_tokenizer, True, 64, 8)(rows)
    assert article["input_ids"].shape == (2, 64)
    assert article["attention_mask"].sum().item() == 17


def test_data_seed_draws_the_rows_whatever_the_seed(tmp_path):
    """--data-seed (default --seed) draws the subsets and the carved validation rows, so runs with other --seeds
    (batch order, head init) can train and be tested on the same rows; a resume checks it with the task's record."""
    data, model = prepare_demo(tmp_path / "demo")
    flags = ["--dataset", str(data), "--model", str(model), "--train-size", "40", "--val-size", "16",
             "--test-size", "16", "--max-length", "32"]

    def drawn(*seeds):
        args = parse_args([*flags, *seeds])
        job = task.setup(args, verbose=False)
        rows = {name: [row.tolist() for row in split["input_ids"]] for name, split in job.datasets.items()}
        return job.decided_flags["data_seed"], job.fingerprint["--data-seed"], rows

    own = drawn("--seed", "1")
    assert own[:2] == (1, 1)
    assert drawn("--seed", "2", "--data-seed", "1") == own
    assert drawn("--seed", "2")[2] != own[2]


def test_set_up_reads_each_column_whole(tmp_path, monkeypatch):
    """Row lengths and labels reach the samplers and the chance loss read whole: a datasets Column read row by row
    selects its table once per row (over a minute of set-up per rank on IMDB's 50,000 rows)."""
    from datasets.arrow_dataset import Column

    from fabric_utils.loaders import make_dataloaders

    whole = Column.__getitem__

    def by_key(column, key):
        assert not isinstance(key, int), f"column {column.column_name} read row by row"
        return whole(column, key)

    data, model = prepare_demo(tmp_path / "demo")
    monkeypatch.setattr(Column, "__getitem__", by_key)
    monkeypatch.setattr(Column, "__iter__", lambda column: by_key(column, 0))
    job = task.setup(parse_args(["--dataset", str(data), "--model", str(model), "--train-size", "40", "--val-size",
                                 "16", "--test-size", "16", "--max-length", "32"]), verbose=False)
    loaders = make_dataloaders(job.datasets, job.collate, job.lengths.per_split, batch_size=4, eval_batch_size=8,
                               world_size=2, rank=1, seed=0, group_by_length=True, num_workers=0, pin_memory=False)
    assert [len(loader) for loader in loaders.values()] == [5, 1, 1]
