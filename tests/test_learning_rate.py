"""--lr's default follows the model's width and the run's length (task.py, ``LR_BY_WIDTH``, ``SHORT_RUN_STEPS``):
the rule on the configurations of real model families, and a run that leaves --lr out trains, records and logs the
peak chosen for its model and its optimizer steps."""

import sys

import pytest
import yaml
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, DistilBertConfig, RobertaConfig

import task
from conftest import logged, run, train
from data.demo import prepare_demo
from task import learning_rate_for
from train import parse_args

MINILM = BertConfig(hidden_size=384)  # all-MiniLM-L6-v2's width, where the rule was measured


@pytest.mark.parametrize("config, steps, lr", [
    (MINILM, 38, 1.2e-4),  # a short run keeps the short-run peak
    (MINILM, 248, 6e-5),  # 4x the short run's steps: half its peak
    (MINILM, 100_000, 5e-5),  # a long run stops at the long-run peak
    (DistilBertConfig(), 38, 5e-5),  # distilbert-base-uncased, the default --model: its config calls the width "dim"
    (BertConfig(), 100_000, 5e-5),  # bert-base: the published recipes' rate, for runs of every length
    (RobertaConfig(hidden_size=1024, num_attention_heads=16), 38, 2e-5),  # roberta-large
])
def test_the_default_learning_rate_follows_the_models_width_and_the_runs_length(config, steps, lr):
    assert learning_rate_for(config, steps) == pytest.approx(lr)


def test_a_run_without_lr_trains_at_the_peak_for_its_model_and_steps_and_records_it(tmp_path):
    data, demo_model = prepare_demo(tmp_path / "demo")
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    model = tmp_path / "minilm-width"  # one layer, as wide as all-MiniLM-L6-v2
    BertForSequenceClassification(BertConfig(vocab_size=len(tokenizer), hidden_size=384, num_hidden_layers=1,
                                             intermediate_size=64, max_position_embeddings=64)).save_pretrained(model)
    tokenizer.save_pretrained(model)
    flags = ["--dataset", str(data), "--model", str(model), "--accelerator", "cpu", "--precision", "32-true",
             "--val-size", "16", "--test-size", "16", "--max-length", "32", "--batch-size", "8", "--warmup", "1",
             "--log-every", "1", "--num-workers", "0"]
    # 2 epochs of 80 batches: 160 optimizer steps, counted from the loaders
    done = run([sys.executable, "train.py", *flags, "--train-size", "640", "--epochs", "2", "--out-dir",
                str(tmp_path / "run")])
    peak = learning_rate_for(MINILM, 160)
    assert peak < learning_rate_for(MINILM, 1)  # else the run's length would not be checked
    assert f"peak --lr {peak:.3g}" in done.stdout  # the run's header says which peak it chose

    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["lr"] == pytest.approx(peak)
    rates = logged(tmp_path / "run", "lr").values()
    assert len(rates) == 160 and max(rates) == pytest.approx(peak)  # the optimizer's peak is the recorded rate

    train([*flags, "--train-size", "64", "--max-steps", "4", "--lr", "1e-4"], tmp_path / "given")
    assert yaml.safe_load((tmp_path / "given" / "config.yaml").read_text())["lr"] == 1e-4  # a given --lr is kept
    assert task.setup(parse_args([*flags, "--lora-r", "4"]), verbose=False).default_lr(160) == task.LORA_LR
