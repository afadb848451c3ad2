"""What unusual input needs, imported only when it comes: label cells read one by one (a label column arrow cannot
type: mixed JSON values, delimited strings, numbers stored as text), and the words of an error about a bad row (where
it sits in its file) or a file the reader refused."""

import csv
import math
import re
from collections import Counter
from pathlib import Path

import pyarrow as pa

from data.labels import TARGET_TYPES
from fabric_utils.errors import UserError, first_line

WRONG = object()  # a cell that holds a value of the wrong kind


def json_kinds(values: list) -> tuple[str | None, str | None]:
    """The most common kind (int, float, str, list, other) of mixed JSON values, and of their list elements."""
    values = [v for v in values if v is not None]
    elements = [e for v in values if isinstance(v, list) for e in v]
    return _most_common(map(kind_of, values)), _most_common(map(kind_of, elements))


def read_cells(cells, problem_type: str, kind: str | None, separator: str | None):
    """(values, missing, wrong) value by value: for mixed JSON values and strings to split or to parse."""
    convert = {("single_label", "int"): _class_id, ("single_label", "str"): _class_name,
               ("regression", None): _number}.get((problem_type, kind))
    if problem_type == "multi_label":
        def convert(cell):
            if isinstance(cell, str) and separator:
                return [part.strip() for part in cell.split(separator) if part.strip()]
            if not isinstance(cell, list):
                return WRONG
            elements = [(_class_id if kind == "int" else _class_name)(e) for e in cell]
            return WRONG if any(e is WRONG for e in elements) else elements
    values, missing, wrong = [], [], []
    for cell in cells:
        value = None if cell is None or isinstance(cell, str) and not cell.strip() else convert(cell)
        missing.append(value is None)
        wrong.append(value is WRONG)
        values.append(None if value is WRONG else value)
    return pa.array(values, TARGET_TYPES[problem_type, kind]), pa.array(missing), pa.array(wrong)


def _class_id(cell):
    return int(cell) if kind_of(cell) == "int" else WRONG


def _class_name(cell):
    return cell if isinstance(cell, str) else WRONG


def _number(cell):
    """A finite number; numeric strings count, as a CSV reads a numeric column with one stray word as strings."""
    if isinstance(cell, bool) or not isinstance(cell, (int, float, str)):
        return WRONG
    try:
        value = float(cell)
    except ValueError:
        return WRONG
    return value if math.isfinite(value) else WRONG


def kind_of(value) -> str:
    if isinstance(value, bool):
        return "other"
    if isinstance(value, int) or isinstance(value, float) and value.is_integer():
        return "int"
    return {float: "float", str: "str", list: "list"}.get(type(value), "other")


def _most_common(kinds) -> str | None:
    counts = Counter(kinds).most_common(1)
    return counts[0][0] if counts else None


def where_rows(rows: list[int], path: Path | None) -> str:
    """Where rows are, as a user finds them: lines of a CSV file (what an editor shows), else data rows."""
    plural = "s" * (len(rows) > 1)
    if path is not None and path.suffix == ".csv":
        return f"line{plural} {', '.join(map(str, _csv_lines(path, rows)))} of {path}"
    return f"row{plural} {', '.join(map(str, rows))}" + (f" of {path}" if path else "") + " (counted from 0)"


def _csv_lines(path: Path, rows: list[int]) -> list[int]:
    """The file line where each data row (counted from 0) starts. Read as pandas reads it: blank lines are
    skipped, the first record is the header, and a quoted cell may span several lines."""
    starts, row, line = {}, -1, 1
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        for record in reader:
            if record:
                starts[row] = line
                row += 1
                if row > max(rows):
                    break
            line = reader.line_num + 1
    return [starts[r] for r in rows]


def unreadable(files: dict[str, Path], file_format: str, err: Exception) -> UserError:
    """The one line for data files the reader refused: no rows, not UTF-8, else the reader's own first line."""
    cause = err
    while cause.__cause__ is not None:  # datasets wraps the reader's own error, which names the line at fault
        cause = cause.__cause__
    empty = re.search(r'Instruction "(\w+)" corresponds to no data', str(err))
    if empty and empty.group(1) in files:  # a header and no rows
        return UserError(f"dataset file {files[empty.group(1)]} has no rows")
    names = sorted(str(f) for f in files.values())
    if isinstance(cause, UnicodeDecodeError):  # most often a spreadsheet's export in Latin-1 or Windows-1252
        byte = cause.object[cause.start:cause.start + 1].hex(" ")
        return UserError(f"dataset files {names} are not UTF-8 text (byte {byte} is not UTF-8): re-save them as UTF-8, "
                         f"e.g. iconv -f cp1252 -t utf-8 FILE > NEW (cp1252 or latin1: what wrote it)")
    return UserError(f"cannot read dataset files {names} as {file_format}: {first_line(cause)[:300]}")
