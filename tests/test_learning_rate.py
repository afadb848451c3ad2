"""--lr's default follows the model's width (task.py, ``LR_BY_WIDTH``, issue 19): the rule on the configurations of
real model families, and a run that leaves --lr out trains, records and logs the rate chosen for its model."""

import csv

import pytest
import yaml
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, DistilBertConfig, RobertaConfig

import task
from conftest import train
from data.demo import prepare_demo
from task import learning_rate_for
from train import parse_args


@pytest.mark.parametrize("config, lr", [
    (BertConfig(hidden_size=384), 1.5e-4),  # all-MiniLM-L6-v2's width, where 1.5e-4 was measured
    (DistilBertConfig(), 5e-5),  # distilbert-base-uncased, the default --model: its config calls the width "dim"
    (BertConfig(), 5e-5),  # bert-base
    (RobertaConfig(hidden_size=1024, num_attention_heads=16), 2e-5),  # roberta-large
])
def test_the_default_learning_rate_follows_the_models_width(config, lr):
    assert learning_rate_for(config) == lr


def test_a_run_without_lr_trains_at_its_models_rate_and_records_it(tmp_path):
    data, demo_model = prepare_demo(tmp_path / "demo")
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    model = tmp_path / "base-width"  # one layer, as wide as a base-size BERT
    BertForSequenceClassification(BertConfig(vocab_size=len(tokenizer), hidden_size=768, num_hidden_layers=1,
                                             intermediate_size=64, max_position_embeddings=64)).save_pretrained(model)
    tokenizer.save_pretrained(model)
    flags = ["--dataset", str(data), "--model", str(model), "--accelerator", "cpu", "--precision", "32-true",
             "--train-size", "64", "--val-size", "16", "--test-size", "16", "--max-length", "32", "--batch-size", "8",
             "--max-steps", "4", "--warmup", "1", "--log-every", "1", "--num-workers", "0", "--quiet"]
    train(flags, tmp_path / "run")

    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["lr"] == 5e-5
    with open(tmp_path / "run" / "logs" / "version_0" / "metrics.csv") as f:
        logged = [float(row["lr"]) for row in csv.DictReader(f) if row.get("lr")]
    assert len(logged) == 4 and max(logged) == pytest.approx(5e-5)  # the optimizer's peak is the recorded rate

    given = parse_args([*flags, "--lr", "1e-4"])
    assert "lr" not in task.setup(given, verbose=False).chosen and given.lr == 1e-4  # a given --lr is kept
    assert task.setup(parse_args([*flags, "--lora-r", "4"]), verbose=False).chosen["lr"] == task.LORA_LR
