"""The text task's parts that only some runs use, each imported only when its input or flag asks: label cells read
one by one (a label column arrow cannot type: mixed JSON values, delimited strings, numbers stored as text) and the
words of an error about a bad row or a file the reader refused; a hub id (``--dataset``, ``--model``); LoRA
(``--lora-r``); the example batch of the flags that probe the model (MFU's FLOPs, ``--batch-size auto``,
``--compile``); predictions on new rows (``predict.py``)."""

import contextlib
import csv
import hashlib
import math
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import torch
from tqdm import tqdm

from data.sources import LOCAL_FORMATS, TARGET_TYPES, blank_text, load_local, rows_count
from data.tokenize import make_collator, tokenize_splits
from fabric_utils.errors import UserError, first_line

WRONG = object()  # a cell that holds a value of the wrong kind


# ---- label cells read one by one, and the words of errors about bad input --------------------------------------------
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


# ---- a hub id --------------------------------------------------------------------------------------------------------
def load_hub_dataset(source: str) -> datasets.DatasetDict:
    """``--dataset`` as a hub id."""
    try:
        return datasets.load_dataset(source)
    except Exception as err:  # the hub raises many kinds; all mean the same to a user here
        raise UserError(f"could not load dataset {source!r} from the hub ({type(err).__name__}); offline, pass a "
                        f"local file or folder to --dataset") from err


def check_hub_model(source: str) -> None:
    """A model that is no local folder: a hub id in the local cache or on a hub that answers one request (without
    network and without the model, the run stops here at once, not after the minute of retries of the hub's
    download); a path is refused."""
    if source.startswith((".", "/", "~")):
        raise UserError(f"model path {source} does not exist (pass a hub id or an existing folder to --model)")
    from huggingface_hub import get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError

    try:
        if try_to_load_from_cache(source, "config.json") is None:
            get_hf_file_metadata(hf_hub_url(source, "config.json"))
    except HfHubHTTPError:  # the hub answered (no such model, gated): from_pretrained says which
        pass
    except Exception as err:  # offline mode, no network, not a hub id: each kind the hub's client raises
        raise UserError(f"model {source} is not on this machine and the hub cannot give it ({first_line(err)}): "
                        f"pass --model PATH, a local model folder") from err


# ---- LoRA ------------------------------------------------------------------------------------------------------------
def add_lora(model, r: int, alpha: float, dropout: float, target_modules: list[str] | None, upcast: bool = True):
    """Freezes ``model`` and adds LoRA adapters (``W + alpha / r * B @ A``, B starting at zero) to the linear layers
    named ``target_modules`` (default: every linear layer of the body, peft's ``all-linear``). The task's head, every
    module outside the pretrained body (a classifier, score, classification head, DeBERTa's pooler: what the load makes
    fresh), trains in full and is exported. ``upcast`` makes the adapters fp32 next to 16-bit weights; a skeleton is
    fp32 already, and under ZeRO-3 its weights take DeepSpeed's one dtype as they are made, which fp32 adapters would
    break. peft is imported only here: it adds a second to every start."""
    from peft import LoraConfig, TaskType, get_peft_model

    body = model.base_model
    head = [name for name, module in model.named_children()
            if module is not body and next(module.parameters(), None) is not None]
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in body.named_modules()
                     if isinstance(module, torch.nn.Linear)})
    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=r, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=list(target_modules or ()) or "all-linear", modules_to_save=head)
    try:
        return get_peft_model(model, config, autocast_adapter_dtype=upcast)
    except ValueError as err:  # peft's check that every name matches a layer
        flag = f"--lora-target-modules {' '.join(target_modules)}" if target_modules else "LoRA"
        raise UserError(f"{flag}: {first_line(err)} (its linear layers: {linear}; pass some with "
                        f"--lora-target-modules)") from err


# ---- the example batch -----------------------------------------------------------------------------------------------
def weights_digest(source: str) -> str:
    """The start of the SHA-256 of a model folder's weight files, wherever the folder is (a hub name: the name)."""
    folder = Path(source)
    if not folder.is_dir():
        return source
    digest = hashlib.sha256()
    for file in sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth")):
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()[:16]


def make_example_batch(tokenizer, objective, rows: int, length: int, device) -> dict:
    """``rows`` copies of a row of ``length`` tokens as the tokenizer makes them, random words between its special
    tokens (T5 and BART check that each row ends in one end-of-text token), with the attention mask the model gets,
    and zero labels of the ``objective``'s kind, on ``device``. A generator of its own: the run's random numbers stay
    as its seed made them."""
    special = set(tokenizer.all_special_ids)
    words = [i for i in range(len(tokenizer)) if i not in special]
    drawn = torch.randint(len(words), (2 * length,), generator=torch.Generator().manual_seed(0)).tolist()
    row = tokenizer(tokenizer.decode([words[i] for i in drawn]), truncation=True, max_length=length)
    row = tokenizer.pad({name: row[name] for name in ("input_ids", "attention_mask")}, padding="max_length",
                        max_length=length, return_tensors="pt")
    labels = {"single_label": lambda: torch.zeros(rows, dtype=torch.long, device=device),
              "multi_label": lambda: torch.zeros(rows, objective.num_labels, device=device),
              "regression": lambda: torch.zeros(rows, device=device)}[objective.problem_type]()
    return {**{name: value.expand(rows, -1).to(device) for name, value in row.items()}, "labels": labels}


# ---- predictions on new rows: predict.py -----------------------------------------------------------------------------
PREDICT_FLAGS = {"text_column", "text_pair_column", "max_length", "pad_to_multiple_of"}  # how the run read its texts


def predict_file(folder: Path, source: Path, flags: dict, batch_size: int) -> dict[str, list]:
    """The exported model's (``folder``) predictions for each row of the file ``source``, whose texts are read as the
    run that trained the model read its data (``flags``: its config.yaml): ``ClassifierObjective.table``'s columns
    and each row's index."""
    from transformers import AutoModelForSequenceClassification

    from task import HF_PROBLEM_TYPES, ClassifierObjective, load_tokenizer, quiet_libraries

    if lacking := sorted(PREDICT_FLAGS - flags.keys()):
        raise UserError(f"the run's config.yaml lacks {', '.join(lacking)}: pass the folder of a run train.py wrote")
    quiet_libraries(bars=False, logs=False)
    rows = read_rows(source)
    texts = [column for column in (flags["text_column"], flags["text_pair_column"]) if column]
    missing = [column for column in texts if column not in rows.column_names]
    if missing:
        raise UserError(f"{source} has no column {missing[0]!r} (its columns: {rows.column_names}); the model was "
                        f"trained on {' and '.join(texts)}")
    check_texts(rows, source, texts)
    tokenizer = load_tokenizer(str(folder))
    try:  # the folder's own code never runs, and its weights are read from safetensors only (no pickle)
        model = AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=False,
                                                                   use_safetensors=True).eval()
    except OSError as err:
        raise UserError(f"cannot load the exported model in {folder}: {first_line(err)} (predict.py reads "
                        f"the model.safetensors train.py exports)") from err
    problem_type = {hf: name for name, hf in HF_PROBLEM_TYPES.items()}[model.config.problem_type]
    objective = ClassifierObjective(problem_type, num_labels=model.config.num_labels,
                                    label_names=[model.config.id2label[i] for i in range(model.config.num_labels)])
    try:
        with held_stderr():
            inputs = tokenize_splits(datasets.DatasetDict(rows=rows.select_columns(texts)), tokenizer,
                                     flags["text_column"], flags["max_length"], flags["text_pair_column"])
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # a tokenizer's panic is a BaseException
        raise UserError(f"the tokenizer of {folder} failed on the rows of {source}: {first_line(err)[:200]}") from err
    inputs = inputs["rows"].remove_columns("length")
    collate = make_collator(tokenizer, False, flags["max_length"], flags["pad_to_multiple_of"])
    predicted = []
    batches = torch.utils.data.DataLoader(inputs, batch_size=batch_size, collate_fn=collate)
    with torch.no_grad():
        for batch in tqdm(batches, desc="predicting", unit="batch", disable=None):  # a bar on a terminal only
            predicted.append(objective.predict(objective.forward(model, batch), batch))
    return objective.table({"row": torch.arange(len(rows)),
                            **{name: torch.cat([b[name] for b in predicted]) for name in predicted[0]}})


def read_rows(path: Path) -> datasets.Dataset:
    """One local file's rows, whatever columns it has: rows to predict."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"{path} is not a file: pass a {', '.join(sorted(LOCAL_FORMATS))} file")
    return load_local({"rows": path})["rows"]


def check_texts(rows: datasets.Dataset, path: Path, columns: list[str]) -> None:
    """Rows to predict have text in each of ``columns``: else one line naming the first rows without any."""
    for column in columns:
        blank = np.flatnonzero(blank_text(rows, column, "--text-column"))
        if len(blank):
            raise UserError(f"{rows_count(len(blank))} of {path} have missing or empty text in column {column!r}, "
                            f"first at {where_rows(blank[:5].tolist(), path)}; fill them in or leave them out")


@contextlib.contextmanager
def held_stderr():
    """The block's writes to file descriptor 2 held back, and shown after it unless it raises: native code (a Rust
    panic in a tokenizer) prints lines of its own that the one-line error it becomes replaces."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        held.seek(0)
        os.write(2, held.read())
