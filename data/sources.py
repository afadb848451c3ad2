"""Load a text-classification dataset as train / validation / test splits with a "labels" column.

A source is a hub id (``stanfordnlp/imdb``), one local file (``.parquet``, ``.csv``, ``.json``, ``.jsonl``) or a
local folder holding ``train`` / ``validation`` / ``test`` files in one of those formats. Every row is checked before
anything else happens: empty text, a missing or mistyped label, or a label the train split never has stops the run
with one line that names the split, the column and the first rows (or, with ``drop_invalid``, leaves such rows
out). Splits the source lacks are then carved from train, deterministically by seed.

Labels, for the three problem types:

    single_label  one class per row: integer class ids or strings   ->  "labels": int64 class id
    multi_label   a list of classes per row: a list column, or a    ->  "labels": float32 multi-hot vector, one
                  string split on ``--label-separator``                 entry per class (an empty list: no class)
    regression    one number per row                                ->  "labels": float32

Reading a split's label column gives one arrow array of one type, null where a row has no usable label, and a row
mask per reason why. Columns whose arrow type already fits are read with arrow compute; mixed JSON values, delimited
strings and columns of another type are read value by value (data/extras.py), which is still fast and names every
bad cell.
"""

import re
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from fabric_utils.errors import UserError

LOCAL_FORMATS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json"}
SPLIT_ALIASES = {"train": ("train",), "validation": ("validation", "valid", "val", "dev"), "test": ("test",)}
DEFAULT_CARVED_SIZE = 5000
MISSING = "missing or empty labels"
EXPECTED = {("single_label", "int"): "integer class ids", ("single_label", "str"): "strings, as in the train split",
            ("multi_label", "int"): "lists of integer class ids", ("multi_label", "str"): "lists of class names",
            ("regression", None): "numbers"}
TARGET_TYPES = {("single_label", "int"): pa.int64(), ("single_label", "str"): pa.string(),
                ("multi_label", "int"): pa.list_(pa.int64()), ("multi_label", "str"): pa.list_(pa.string()),
                ("regression", None): pa.float64()}


@dataclass
class LabelledSplits:
    splits: datasets.DatasetDict  # train / validation / test: the text column(s) and "labels" (see the labels section)
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
            from data.extras import where_rows
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
    from data.extras import load_hub_dataset
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
        from data.extras import unreadable
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


# ---- labels ----------------------------------------------------------------------------------------------------------
def resolve_problem_type(train: datasets.Dataset, column: str, problem_type: str,
                         separator: str | None) -> tuple[str, str | None]:
    """The problem type, detected from the train split for "auto", and the kind of class names: "int" or "str"
    (None for regression). Detection: a list, or a string with ``separator`` set, is multi_label; a number with a
    fraction is regression; integers and strings are single_label."""
    kind, element_kind = _train_kinds(train, column)
    if problem_type == "auto":
        if kind == "list" or kind == "str" and separator:
            problem_type = "multi_label"
        elif kind == "float":
            problem_type = "regression"
        elif kind in ("int", "str"):
            problem_type = "single_label"
        else:
            raise UserError(f"cannot tell the problem type from column {column!r} of the train split, which holds "
                            f"{_describe_type(train, column)}: set --label-column or --problem-type")
    if problem_type == "regression":
        return problem_type, None
    if problem_type == "multi_label" and kind == "str" and not separator:
        raise UserError(f"column {column!r} holds strings, not lists: for --problem-type multi_label set "
                        f"--label-separator (e.g. ',') or store each row's labels as a list (parquet, JSON lines)")
    class_kind = kind
    if problem_type == "multi_label" and kind == "list":  # only empty lists have no element kind: label_names says
        class_kind = element_kind or "str"
    if problem_type == "single_label" and class_kind == "float":
        class_kind = "int"  # numbers with a fraction: read as class ids, and the fractions named as bad rows
    if class_kind not in ("int", "str"):
        raise UserError(f"column {column!r} of the train split holds {_describe_type(train, column)}, but "
                        f"{problem_type} labels must be integer class ids or strings")
    if problem_type == "single_label" and class_kind == "str" and _arrow_kind(train.data.column(column).type) == "str":
        _refuse_mixed_kinds(train.data.column(column), column)
    return problem_type, class_kind


def _refuse_mixed_kinds(column: pa.ChunkedArray, name: str) -> None:
    """A CSV column of ``0``/``1`` and ``pos``/``neg`` reads as strings: four classes, where the data meant two."""
    names = {cell.strip() for cell in pc.unique(column).to_pylist() if cell and cell.strip()}
    ids = sorted((cell for cell in names if re.fullmatch(r"[+-]?\d+", cell)), key=int)
    words = sorted(names - set(ids))
    if ids and words:
        raise UserError(f"column {name!r} of the train split mixes integer class ids ({', '.join(ids[:3])}) with "
                        f"class names ({', '.join(words[:3])}), which would train as {len(names)} classes; give "
                        f"every row the same kind of label")


def read_labels(split: datasets.Dataset, column: str, problem_type: str, kind: str | None,
                separator: str | None) -> tuple[pa.Array, dict[str, np.ndarray]]:
    """The split's labels as one arrow array of the problem type's type (null where a row's label is unusable),
    and per reason, a mask of the rows whose label is unusable for it."""
    read = None if isinstance(split.features[column], datasets.Json) else _read_arrow(
        split.data.column(column).combine_chunks(), problem_type, kind)
    if read is None:  # mixed JSON values, delimited strings, or a type that needs converting: value by value
        from data.extras import read_cells
        read = read_cells(split[column][:], problem_type, kind, separator)
    values, missing, wrong = read
    wrong = _mask(wrong, len(values))
    problems = {MISSING: _mask(missing, len(values))}
    if wrong.any():
        examples = dict.fromkeys(map(repr, split.select(np.flatnonzero(wrong)[:20])[column][:]))
        problems[f"labels that are not {EXPECTED[problem_type, kind]} ({', '.join(list(examples)[:3])})"] = wrong
    if kind == "int":
        ids, rows = _class_elements(values)
        negative = pc.less(ids, 0)
        if pc.any(negative).as_py():
            problems[f"negative labels {_first_distinct(ids.filter(negative))} (class ids count from 0)"] = (
                _rows_with(rows.filter(negative), len(values)))
    return values, problems


def unseen_labels(values: pa.Array, train_values: pa.Array) -> dict[str, np.ndarray]:
    """The rows with a class the train split never has: the model could not learn it."""
    ids, rows = _class_elements(values)
    unseen = pc.invert(pc.is_in(ids, value_set=pc.unique(_class_elements(train_values)[0])))
    if not pc.any(unseen).as_py():
        return {}
    return {f"labels not seen in training {_first_distinct(ids.filter(unseen))}": _rows_with(rows.filter(unseen),
                                                                                               len(values))}


def label_names(train_values: pa.Array, feature, problem_type: str, kind: str | None, column: str) -> list[str]:
    """Class names in id order: integer ids 0..max, or sorted strings, so every run and rank agrees; for
    regression the label column's name, the one output of the model."""
    if problem_type == "regression":
        return [column]
    if isinstance(feature, datasets.ClassLabel):
        return list(feature.names)
    classes = pc.unique(_class_elements(train_values)[0])
    if len(classes) == 0:  # multi_label rows that all have an empty list
        raise UserError(f"no row of the train split has a label in column {column!r}")
    names = [str(i) for i in range(pc.max(classes).as_py() + 1)] if kind == "int" else sorted(classes.to_pylist())
    if problem_type == "single_label" and len(names) < 2:
        raise UserError(f"the train split has only one label {names} in column {column!r}: single-label "
                        f"classification needs two or more")
    return names


def encode_labels(values: pa.Array, names: list[str], problem_type: str, kind: str | None):
    """The "labels" column and its datasets feature: class ids, multi-hot float32 vectors or float32 numbers."""
    if problem_type == "regression":
        return pc.cast(values, pa.float32()), datasets.Value("float32")
    ids, rows = _class_elements(values)
    if kind == "str":
        ids = pc.index_in(ids, value_set=pa.array(names))
    if problem_type == "single_label":
        return pc.cast(ids, pa.int64()), datasets.Value("int64")
    multi_hot = np.zeros((len(values), len(names)), dtype=np.float32)
    multi_hot[rows.to_numpy(), ids.to_numpy()] = 1.0
    return (pa.FixedSizeListArray.from_arrays(multi_hot.ravel(), len(names)),
            datasets.List(datasets.Value("float32"), length=len(names)))


def is_blank(strings: pa.Array) -> pa.Array:
    """True for empty and whitespace-only strings, null for null."""
    return pc.or_(pc.equal(pc.utf8_length(strings), 0), pc.utf8_is_space(strings))


def _train_kinds(train: datasets.Dataset, column: str) -> tuple[str, str | None]:
    """The most common kind of the train split's labels (int, float, str, list, other), and of list elements."""
    if isinstance(train.features[column], datasets.Json):
        from data.extras import json_kinds
        return json_kinds(train[column][:])
    arrow_type = train.data.column(column).type
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return "list", None if pa.types.is_null(arrow_type.value_type) else _arrow_kind(arrow_type.value_type)
    kind = _arrow_kind(arrow_type)
    if kind == "float" and _all_whole(train.data.column(column)):
        kind = "int"  # integer labels with an empty cell: pandas reads them as floats
    return kind, None


def _read_arrow(column: pa.Array, problem_type: str, kind: str | None):
    """(values, missing, wrong) with arrow compute where the column's type fits the problem type, else None."""
    arrow_type = column.type
    numeric = pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type)
    if numeric and (problem_type == "regression" or problem_type == "single_label" and kind == "int"):
        values = pc.cast(column, pa.float64())
        missing = pc.fill_null(pc.is_nan(values), True)  # readers turn an empty CSV cell into null, parquet into NaN
        wrong = pc.is_inf(values)
        if problem_type == "single_label":
            wrong = pc.or_(wrong, pc.not_equal(pc.floor(values), values))
        wrong = pc.and_not(wrong, missing)
        values = pc.if_else(pc.or_(missing, wrong), None, values)
        return (pc.cast(values, pa.int64()) if problem_type == "single_label" else values), missing, wrong
    if problem_type == "single_label" and kind == "str" and _arrow_kind(arrow_type) == "str":
        missing = pc.fill_null(is_blank(column), True)
        return pc.cast(pc.if_else(missing, None, column), pa.string()), missing, None
    is_list = pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)
    if (problem_type == "multi_label" and is_list and _arrow_kind(arrow_type.value_type) == kind
            and not pc.list_flatten(column).null_count):  # a null inside a list is a bad cell, named value by value
        return pc.cast(column, TARGET_TYPES[problem_type, kind]), pc.is_null(column), None
    return None


def _arrow_kind(arrow_type) -> str:
    if pa.types.is_integer(arrow_type):
        return "int"
    if pa.types.is_floating(arrow_type):
        return "float"
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "str"
    return "other"


def _all_whole(column: pa.ChunkedArray) -> bool:
    column = pc.filter(column, pc.is_finite(column))
    return pc.all(pc.equal(pc.floor(column), column)).as_py() is not False


def _describe_type(split: datasets.Dataset, column: str) -> str:
    feature = split.features[column]
    return "mixed JSON values" if isinstance(feature, datasets.Json) else f"{split.data.column(column).type} values"


def _class_elements(values: pa.Array) -> tuple[pa.Array, pa.Array]:
    """The classes of all rows as one flat array, and the row each belongs to (lists give several per row)."""
    if pa.types.is_list(values.type):
        return pc.list_flatten(values), pc.list_parent_indices(values)
    valid = pc.is_valid(values)
    return values.filter(valid), pc.indices_nonzero(valid)


def _rows_with(rows: pa.Array, num_rows: int) -> np.ndarray:
    mask = np.zeros(num_rows, dtype=bool)
    mask[rows.to_numpy()] = True
    return mask


def _mask(flags, num_rows: int) -> np.ndarray:
    """A numpy row mask from an arrow boolean array (null counts as False); None: no row."""
    if flags is None:
        return np.zeros(num_rows, dtype=bool)
    return pc.fill_null(flags, False).to_numpy(zero_copy_only=False)


def _first_distinct(values: pa.Array, count=5) -> list:
    return sorted(pc.unique(values).to_pylist(), key=str)[:count]
