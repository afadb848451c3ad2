"""Load a text-classification dataset as train / validation / test splits with integer labels.

A source is a hub id (``stanfordnlp/imdb``), one local file (``.parquet``, ``.csv``, ``.json``, ``.jsonl``) or a
local folder holding ``train`` / ``validation`` / ``test`` files in one of those formats. Splits the source lacks
are carved from train, deterministically by seed.
"""

import re
from dataclasses import dataclass
from pathlib import Path

import datasets

from fabric_utils.errors import UserError

LOCAL_FORMATS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json"}
SPLIT_ALIASES = {"train": ("train",), "validation": ("validation", "valid", "val", "dev"), "test": ("test",)}
DEFAULT_CARVED_SIZE = 5000


@dataclass
class LabelledSplits:
    splits: datasets.DatasetDict  # train / validation / test, columns: text column and "labels" (int)
    label_names: list[str]


def load_splits(source, text_column="text", label_column="label", seed=123,
                train_size=None, val_size=None, test_size=None) -> LabelledSplits:
    raw = _load_raw(source)
    for name, split in raw.items():
        missing = [c for c in (text_column, label_column) if c not in split.column_names]
        if missing:
            raise UserError(f"the {name} split of {source} has no column {', '.join(map(repr, missing))}; "
                            f"its columns are {split.column_names} (set --text-column / --label-column)")
        if len(split) == 0:
            raise UserError(f"the {name} split of {source} is empty")
    raw = raw.select_columns([text_column, label_column])
    raw, label_names = _labels_to_ids(raw, label_column)
    splits = _carve_missing_splits(raw, seed, val_size)
    splits = datasets.DatasetDict({
        name: _subset(split, size, seed)
        for (name, split), size in zip(splits.items(), (train_size, val_size, test_size))
    })
    return LabelledSplits(splits, label_names)


def _load_raw(source) -> datasets.DatasetDict:
    path = Path(source).expanduser()
    if path.is_file():
        return _load_local({"train": path})
    if path.is_dir():
        files = {}
        for split, aliases in SPLIT_ALIASES.items():
            found = [f for a in aliases for f in sorted(path.glob(f"{a}.*")) if f.suffix in LOCAL_FORMATS]
            if found:
                files[split] = found[0]
        if "train" not in files:
            raise UserError(f"dataset folder {path} has no train file (expected train.parquet, train.csv, "
                            f"train.json or train.jsonl)")
        return _load_local(files)
    if path.suffix in LOCAL_FORMATS or str(source).startswith((".", "/", "~")):
        raise UserError(f"dataset path {source} does not exist (pass an existing file or folder to --dataset)")
    try:
        raw = datasets.load_dataset(str(source))
    except Exception as err:  # the hub raises many kinds; all mean the same to a user here
        raise UserError(f"could not load dataset {source!r} from the hub ({type(err).__name__}); offline, pass a "
                        f"local file or folder to --dataset") from err
    return datasets.DatasetDict({split: raw[name] for split, aliases in SPLIT_ALIASES.items()
                                 for name in aliases if name in raw})


def _load_local(files: dict) -> datasets.DatasetDict:
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
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        empty = re.search(r'Instruction "(\w+)" corresponds to no data', message)
        if empty and empty.group(1) in files:  # a header and no rows
            raise UserError(f"dataset file {files[empty.group(1)]} has no rows") from err
        raise UserError(f"cannot read dataset files {sorted(str(f) for f in files.values())} as {file_format}: "
                        f"{message[:300]}") from err


def _labels_to_ids(raw: datasets.DatasetDict, label_column: str):
    """Map labels to ids 0..K-1. String labels are sorted so every run and rank agrees on the mapping."""
    feature = raw["train"].features[label_column]
    if isinstance(feature, datasets.ClassLabel):
        return raw.rename_column(label_column, "labels"), list(feature.names)
    values = set()
    for split in raw.values():
        values.update(split.unique(label_column))
    if None in values:
        raise UserError(f"column {label_column!r} has missing labels")
    if all(isinstance(v, str) for v in values):
        names = sorted(values)
        to_id = {name: i for i, name in enumerate(names)}
        raw = raw.map(lambda b: {"labels": [to_id[v] for v in b[label_column]]}, batched=True,
                      remove_columns=[label_column])
        return raw, names
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise UserError(f"column {label_column!r} must hold integer or string labels, found {sorted(map(repr, values))[:5]}")
    if min(values) < 0:
        raise UserError(f"column {label_column!r} has negative labels {sorted(v for v in values if v < 0)[:5]}; "
                        f"integer labels must be class ids 0..K-1")
    return raw.rename_column(label_column, "labels"), [str(i) for i in range(max(values) + 1)]


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
        parts = splits["train"].train_test_split(test_size=size, seed=seed)
        splits["train"], splits[name] = parts["train"], parts["test"]
    return datasets.DatasetDict({name: splits[name] for name in ("train", "validation", "test")})


def _subset(split: datasets.Dataset, size, seed: int) -> datasets.Dataset:
    """A seeded random subset: sources are often sorted by label (IMDB is), so the first rows would do."""
    if size is None or size >= len(split):
        return split
    return split.shuffle(seed=seed).select(range(size)).flatten_indices()
