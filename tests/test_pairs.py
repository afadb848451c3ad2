"""Sentence pairs (--text-pair-column): tokenized as the model expects, checked like the first text, and a
pair task that needs both texts learns where the first text alone is at chance."""

import json
import random
import subprocess
import sys

import pandas as pd
import pytest
import torch
from transformers import (BertConfig, BertForSequenceClassification, BertTokenizer, DistilBertConfig,
                          DistilBertForSequenceClassification, DistilBertTokenizer)

from conftest import REPO, Job, run, subprocess_env
from data.demo import FILLER, NEGATIVE, POSITIVE, SPECIAL, prepare_demo
from data.sources import load_splits
from data.tokenize import make_collator, tokenize_splits
from fabric_utils.errors import UserError
from task import ClassifierObjective

VOCAB = {token: i for i, token in enumerate(SPECIAL + sorted(set(POSITIVE + NEGATIVE + FILLER)))}
ROWS = pd.DataFrame({"text": ["a great film", "dull and boring", "quite good acting", "awful plot"] * 5,
                     "pair": ["the cast was good", "it was bad", "the music", "the ending was weak"] * 5,
                     "label": [1, 0, 1, 0] * 5})


def error_of(*args, **kwargs) -> str:
    with pytest.raises(UserError) as err:
        load_splits(*args, **kwargs)
    return str(err.value)


# BERT (and MiniLM) were pretrained with a segment embedding per text; DistilBERT dropped it and its forward takes no
# token_type_ids: tiny models of both, with tokenizers of their own classes over the demo's words
@pytest.mark.parametrize("tokenizer_class, model_class, config", [
    (BertTokenizer, BertForSequenceClassification,
     BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=64)),
    (DistilBertTokenizer, DistilBertForSequenceClassification,
     DistilBertConfig(vocab_size=len(VOCAB), dim=32, n_layers=1, n_heads=2, hidden_dim=64)),
])
def test_pairs_are_tokenized_and_fed_the_way_the_model_expects(tmp_path, monkeypatch, tokenizer_class, model_class,
                                                               config):
    ROWS.to_parquet(tmp_path / "pairs.parquet")
    splits = load_splits(tmp_path / "pairs.parquet", text_pair_column="pair", seed=0).splits
    tokenizer = tokenizer_class(vocab=VOCAB)
    pairs = tokenize_splits(splits, tokenizer, "text", max_length=8, text_pair_column="pair")["train"]
    row, rows = splits["train"][0], pairs.select(range(4)).remove_columns("length")
    assert pairs[0]["input_ids"] == tokenizer(row["text"], row["pair"], truncation=True, max_length=8)["input_ids"]
    assert tokenizer.decode(pairs[0]["input_ids"]).count("[SEP]") == 2  # [CLS] text [SEP] pair [SEP], cut to 8
    uses_types = "token_type_ids" in tokenizer.model_input_names
    assert ("token_type_ids" in pairs.column_names) == uses_types
    single = tokenize_splits(splits, tokenizer, "text", max_length=8)["train"]  # same data: the key has the columns
    assert "token_type_ids" not in single.column_names and single["input_ids"] != pairs["input_ids"]
    calls = []
    monkeypatch.setattr(type(tokenizer), "__call__", lambda *a, **k: calls.append(1))
    again = tokenize_splits(splits, tokenizer, "text", max_length=8, text_pair_column="pair")["train"]
    assert calls == [] and again["input_ids"] == pairs["input_ids"]  # read from the cache
    monkeypatch.undo()

    batch = make_collator(tokenizer, False, 8, 8)([rows[i] for i in range(len(rows))])
    torch.manual_seed(0)
    model = model_class(config).eval()
    logits = ClassifierObjective("single_label", 2).forward(model, batch)  # DistilBERT: no token_type_ids to refuse
    if uses_types:
        assert batch["token_type_ids"].any()  # the pair's tokens are segment 1
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        torch.testing.assert_close(logits, model(**inputs).logits)
        without_types = {k: v for k, v in inputs.items() if k != "token_type_ids"}
        assert not torch.allclose(logits, model(**without_types).logits)


def test_the_pair_column_is_checked_like_the_text_column(tmp_path):
    path = tmp_path / "pairs.csv"
    rows = ROWS.assign(stars=4)
    rows.loc[[3, 7], "pair"] = ["", None]
    rows.to_csv(path, index=False)
    assert error_of(path, text_pair_column="answer") == (
        f"the train split of {path} has no column 'answer'; its columns are ['text', 'pair', 'label', 'stars'] "
        f"(set --text-column / --text-pair-column / --label-column)")
    assert error_of(path, text_pair_column="text") == (
        "--text-column / --text-pair-column / --label-column must name different columns, not ['text', 'text', "
        "'label']")
    assert error_of(path, text_pair_column="pair") == (
        f"the train split has 2 rows with missing or empty text in column 'pair', first at lines 5, 9 of {path}; "
        f"fix the data or pass --drop-invalid to leave such rows out")
    data = load_splits(path, text_pair_column="pair", drop_invalid=True)
    assert data.dropped == {"train": {"missing or empty text in column 'pair'": 2}}
    assert error_of(path, text_pair_column="stars") == (
        "column 'stars' holds int64 values, not text: set --text-pair-column to the column with the text")


def test_a_missing_pair_column_ends_the_run_with_one_line(tmp_path):
    _, model = prepare_demo(tmp_path / "demo")
    ROWS.to_parquet(tmp_path / "pairs.parquet")
    result = run([sys.executable, "train.py", "--dataset", tmp_path / "pairs.parquet", "--model", model,
                  "--text-pair-column", "question", "--accelerator", "cpu", "--quiet", "--out-dir", tmp_path / "run"],
                 check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert [line for line in result.stderr.splitlines() if "error: " in line] == [
        f"error: the train split of {tmp_path / 'pairs.parquet'} has no column 'question'; its columns are "
        f"['text', 'pair', 'label'] (set --text-column / --text-pair-column / --label-column)"]


PAIR_CHECK = r"""
import json, sys
import pandas as pd, torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

model_dir, rows = sys.argv[1], pd.read_parquet(sys.argv[2])
model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
tokenizer = AutoTokenizer.from_pretrained(model_dir)
with torch.no_grad():  # the tokenizer's own pair call, as a user of the export would write it
    encoded = tokenizer(list(rows.text), list(rows.pair), padding=True, return_tensors="pt")
    predicted = model(**encoded).logits.argmax(-1)
names = [model.config.id2label[int(i)] for i in predicted]
print(json.dumps({"acc": sum(n == label for n, label in zip(names, rows.label)) / len(rows)}))
"""


def same_or_different(rows: int, seed: int) -> pd.DataFrame:
    """Is the pair's sentiment word the text's? Each text alone is a word drawn at random, the same in both
    classes, so the text alone says nothing about the label (chance is 0.5); the pair decides it."""
    rng, words = random.Random(seed), POSITIVE[:6] + NEGATIVE[:6]
    made = []
    for _ in range(rows):
        word, same = rng.choice(words), rng.random() < 0.5
        other = word if same else rng.choice([w for w in words if w != word])
        made.append({"text": f"the film was {word}", "pair": f"it was {other}",
                     "label": "same" if same else "different"})
    return pd.DataFrame(made)


def test_a_pair_task_that_needs_both_texts_learns_only_with_the_pair_column(tmp_path):
    # the demo's tiny BERT from random weights; its word-level tokenizer has no pair template and joins the texts
    _, model = prepare_demo(tmp_path / "demo")
    (tmp_path / "data").mkdir()
    same_or_different(2400, seed=0).to_parquet(tmp_path / "data" / "train.parquet")
    same_or_different(300, seed=1).to_parquet(tmp_path / "data" / "test.parquet")
    flags = ["--dataset", str(tmp_path / "data"), "--model", str(model), "--accelerator", "cpu", "--precision",
             "32-true", "--num-workers", "0", "--max-length", "16", "--epochs", "3", "--batch-size", "32", "--lr",
             "3e-3", "--hidden-dropout", "0", "--quiet",
             # decaying to 0: from random weights at this rate, a floor of 30% of the peak can hold a draw at chance
             "--min-lr-rate", "0"]
    jobs = {"pairs": Job(tmp_path / "pairs", *flags, "--text-pair-column", "pair"),
            "text alone": Job(tmp_path / "text", *flags)}  # started together: two cores
    found = {name: job.results()["test_acc"] for name, job in jobs.items()}
    assert found["pairs"] >= 0.8 and found["text alone"] <= 0.6, found
    done = subprocess.run([sys.executable, "-c", PAIR_CHECK, str(tmp_path / "pairs" / "model"),
                           str(tmp_path / "data" / "test.parquet")], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["acc"] == pytest.approx(found["pairs"], abs=2 / 300)
