"""Load a text-classification dataset as train / validation / test splits with a "labels" column.

A source is a hub id (``stanfordnlp/imdb``), one local file (``.parquet``, ``.csv``, ``.json``, ``.jsonl``) or a
local folder holding ``train`` / ``validation`` / ``test`` files in one of those formats. Every row is checked before
anything else happens: empty text, a missing or mistyped label, or a label the train split never has stops the run
with one line that names the split, the column and the first rows (or, with ``drop_invalid``, leaves such rows
out). Splits the source lacks are then carved from train, deterministically by seed.
"""

from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data.labels import encode_labels, is_blank, label_names, read_labels, resolve_problem_type, unseen_labels
from fabric_utils.errors import UserError

LOCAL_FORMATS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json"}
SPLIT_ALIASES = {"train": ("train",), "validation": ("validation", "valid", "val", "dev"), "test": ("test",)}
DEFAULT_CARVED_SIZE = 5000


@dataclass
class LabelledSplits:
    splits: datasets.DatasetDict  # train / validation / test: the text column(s) and "labels" (see data/labels.py)
    label_names: list[str]  # class names in id order; for regression [label column], the model's one output
    problem_type: str = "single_label"  # or multi_label or regression: picks the loss, the metrics and the head
    dropped: dict[str, dict[str, int]] = field(default_factory=dict)  # drop_invalid: {split: {why: rows}}

    def drop_report(self) -> list[str]:
        """One line per split that lost rows to ``drop_invalid``, for the first process to print."""
        return [f"--drop-invalid left out {rows_count(sum(why.values()))} of the {split} split: "
                + ", ".join(f"{count} with {reason}" for reason, count in why.items())
                for split, why in self.dropped.items()]


def load_splits(source, text_column="text", label_column="label", seed=123, train_size=None, val_size=None,
                test_size=None, problem_type="auto", label_separator=None, drop_invalid=False,
                text_pair_column=None) -> LabelledSplits:
    """``problem_type``: single_label, multi_label, regression, or auto (from the train split's label column).
    ``label_separator`` splits string labels into a multi_label list. ``drop_invalid`` leaves out the rows that
    would otherwise stop the run. ``text_pair_column``: each row's second text (sentence pairs), checked like the
    first."""
    flags = {"--text-column": text_column, "--text-pair-column": text_pair_column, "--label-column": label_column}
    flags = {flag: column for flag, column in flags.items() if column}  # the flag naming each column, for errors
    if len(set(flags.values())) < len(flags):
        raise UserError(f"{' / '.join(flags)} must name different columns, not {list(flags.values())}")
    raw, files = _load_raw(source)
    for name, split in raw.items():
        missing = [c for c in flags.values() if c not in split.column_names]
        if missing:
            raise UserError(f"the {name} split of {source} has no column {', '.join(map(repr, missing))}; "
                            f"its columns are {split.column_names} (set {' / '.join(flags)})")
        if len(split) == 0:
            raise UserError(f"the {name} split of {source} is empty")
    raw = raw.select_columns(list(flags.values()))
    texts = {column: flag for flag, column in flags.items() if flag != "--label-column"}
    problem_type, kind = resolve_problem_type(raw["train"], label_column, problem_type, label_separator)
    raw, names, dropped = _check_and_encode(raw, files, texts, label_column, problem_type, kind,
                                            label_separator, drop_invalid)
    splits = _carve_missing_splits(raw, seed, val_size)
    splits = datasets.DatasetDict({
        name: _subset(name, split, size, flag, seed)
        for (name, split), size, flag in zip(splits.items(), (train_size, val_size, test_size),
                                             ("--train-size", "--val-size", "--test-size"))
    })
    return LabelledSplits(splits, names, problem_type, dropped)


def _check_and_encode(raw: datasets.DatasetDict, files: dict[str, Path], texts: dict[str, str], label_column: str,
                      problem_type: str, kind: str | None, separator: str | None, drop_invalid: bool):
    """Checks every row of every split, stops at (or drops) bad ones, and replaces the label column with "labels".
    ``texts``: each text column and its flag. Returns the splits, the label names and the rows dropped per split and
    reason."""
    kept, labels, dropped = {}, {}, {}
    for name, split in raw.items():  # train first: the other splits are checked against its labels
        labels[name], problems = read_labels(split, label_column, problem_type, kind, separator)
        if name != "train":
            problems.update(unseen_labels(labels[name], labels["train"]))
        problems = {**{f"missing or empty text in column {column!r}": blank_text(split, column, flag)
                       for column, flag in texts.items()},
                    **{f"{why} in column {label_column!r}": rows for why, rows in problems.items()}}
        keep, why = _keep_rows(name, len(split), problems, files.get(name), drop_invalid)
        kept[name] = split if keep.all() else split.select(np.flatnonzero(keep))
        labels[name] = labels[name].filter(keep)
        if why:
            dropped[name] = why
    names = label_names(labels["train"], raw["train"].features[label_column], problem_type, kind, label_column)
    encoded = datasets.DatasetDict()
    for name, split in kept.items():
        column, feature = encode_labels(labels[name], names, problem_type, kind)
        encoded[name] = split.remove_columns(label_column).add_column("labels", column, feature=feature)
    return encoded, names, dropped


def blank_text(split: datasets.Dataset, column: str, flag: str) -> np.ndarray:
    text = split.data.column(column)
    if text.null_count == len(text):  # a CSV column with no text at all reads as numbers
        return np.ones(len(text), dtype=bool)
    if not (pa.types.is_string(text.type) or pa.types.is_large_string(text.type)):
        raise UserError(f"column {column!r} holds {text.type} values, not text: set {flag} to the column with "
                        f"the text")
    return pc.fill_null(is_blank(text), True).to_numpy(zero_copy_only=False)


def _keep_rows(split: str, num_rows: int, problems: dict[str, np.ndarray], path: Path | None, drop_invalid: bool):
    """The rows to keep and, per reason, how many are dropped (a row with several problems counts once, for the
    first). Without ``drop_invalid`` the first problem found is an error naming its first rows."""
    bad, dropped = np.zeros(num_rows, dtype=bool), {}
    for why, rows in problems.items():
        if not rows.any():
            continue
        if not drop_invalid:
            from data.cells import where_rows
            found = np.flatnonzero(rows)
            raise UserError(f"the {split} split has {rows_count(len(found))} with {why}, first at "
                            f"{where_rows(found[:5].tolist(), path)}; fix the data or pass --drop-invalid to leave "
                            f"such rows out")
        if (rows & ~bad).any():
            dropped[why] = int((rows & ~bad).sum())
        bad |= rows
    if bad.all():
        raise UserError(f"--drop-invalid left no rows in the {split} split ({', '.join(dropped)})")
    return ~bad, dropped


def rows_count(count: int) -> str:
    return f"{count} row{'s' * (count != 1)}"


def _load_raw(source) -> tuple[datasets.DatasetDict, dict[str, Path]]:
    """The source's splits, and for local files, the file of each split."""
    path = Path(source).expanduser()
    if path.is_file():
        return load_local({"train": path}), {"train": path}
    if path.is_dir():
        files = {}
        for split, aliases in SPLIT_ALIASES.items():
            found = [f for a in aliases for f in sorted(path.glob(f"{a}.*")) if f.suffix in LOCAL_FORMATS]
            if found:
                files[split] = found[0]
        if "train" not in files:
            raise UserError(f"dataset folder {path} has no train file (expected train.parquet, train.csv, "
                            f"train.json or train.jsonl)")
        return load_local(files), files
    if path.suffix in LOCAL_FORMATS or str(source).startswith((".", "/", "~")):
        raise UserError(f"dataset path {source} does not exist (pass an existing file or folder to --dataset)")
    from data.hub import load_hub_dataset
    raw = load_hub_dataset(str(source))
    return datasets.DatasetDict({split: raw[name] for split, aliases in SPLIT_ALIASES.items()
                                 for name in aliases if name in raw}), {}


def load_local(files: dict) -> datasets.DatasetDict:
    formats = {LOCAL_FORMATS.get(f.suffix) for f in files.values()}
    if None in formats or len(formats) != 1:
        raise UserError(f"dataset files {sorted(str(f) for f in files.values())} must share one format of "
                        f"{sorted(LOCAL_FORMATS)}")
    for f in files.values():
        if f.stat().st_size == 0:
            raise UserError(f"dataset file {f} is empty")
    file_format = formats.pop()
    try:
        return datasets.load_dataset(file_format, data_files={k: str(v) for k, v in files.items()})
    except Exception as err:  # pyarrow, pandas and datasets each raise their own kinds for a bad file
        from data.cells import unreadable
        raise unreadable(files, file_format, err) from err


def _carve_missing_splits(raw: datasets.DatasetDict, seed: int, val_size) -> datasets.DatasetDict:
    splits = dict(raw)
    source_rows = len(splits["train"])
    for name in ("validation", "test"):
        if name in splits:
            continue
        wanted = val_size if name == "validation" and val_size else DEFAULT_CARVED_SIZE
        size = min(wanted, source_rows // 5)  # IMDB's 25,000 training rows give the default 5,000
        if size == 0:
            raise UserError(f"the dataset has {source_rows} training rows and no {name} split: too few to carve one")
        if name == "validation" and val_size and size < val_size:
            raise UserError(f"--val-size {val_size}: the dataset has no validation split, and a fifth of its "
                            f"{source_rows} training rows, {size}, is the most carved for one; pass --val-size {size} "
                            f"or less")
        parts = splits["train"].train_test_split(test_size=size, seed=seed)
        splits["train"], splits[name] = parts["train"], parts["test"]
    return datasets.DatasetDict({name: splits[name] for name in ("train", "validation", "test")})


def _subset(name: str, split: datasets.Dataset, size, flag: str, seed: int) -> datasets.Dataset:
    """A seeded random subset: sources are often sorted by label (IMDB is), so the first rows would do. More rows
    than the split has is a ``UserError`` naming how many it has."""
    if size is not None and size > len(split):
        raise UserError(f"{flag} {size}: the {name} split has {len(split)} rows; pass {len(split)} or less, or leave "
                        f"{flag} out to use them all")
    if size is None or size == len(split):
        return split
    return split.shuffle(seed=seed).select(range(size)).flatten_indices()
