"""Predictions on new rows (``predict.py``): a file read as the run that trained the model read its data, through the
exported Hugging Face folder. Imported only by ``task.predict``."""

import contextlib
import os
import sys
import tempfile
from pathlib import Path

import datasets
import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoModelForSequenceClassification

from data.cells import where_rows
from data.sources import LOCAL_FORMATS, blank_text, load_local, rows_count
from data.tokenize import make_collator, tokenize_splits
from fabric_utils.errors import UserError, first_line
from task import HF_PROBLEM_TYPES, ClassifierObjective, load_tokenizer, quiet_libraries

PREDICT_FLAGS = {"text_column", "text_pair_column", "max_length", "pad_to_multiple_of"}  # how the run read its texts


def predict_file(folder: Path, source: Path, flags: dict, batch_size: int) -> dict[str, list]:
    """The exported model's (``folder``) predictions for each row of the file ``source``, whose texts are read as the
    run that trained the model read its data (``flags``: its config.yaml): ``ClassifierObjective.table``'s columns
    and each row's index."""
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
