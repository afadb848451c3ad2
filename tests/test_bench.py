"""The benchmark scripts' own logic: the Trainer row's model settings and the study's validation clock."""

import sys
from pathlib import Path

import pytest

from data.demo import prepare_demo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import hf_trainer, study  # noqa: E402
from train import flag_parser  # noqa: E402


def test_hf_trainer_builds_the_templates_model_settings():
    _, model_dir = prepare_demo(Path.home() / ".cache" / "fabric-template" / "demo")
    template = flag_parser().parse_args([])
    args = hf_trainer.parse_args(["--dataset", "unused", "--model", str(model_dir), "--out-dir", "unused"])
    model = hf_trainer.build_model(args.model, ["neg", "pos"], args.attention_dropout, args.hidden_dropout)
    own = type(model.config).from_pretrained(model_dir)
    assert own.attention_probs_dropout_prob != template.attention_dropout  # else this test could not fail
    assert model.config.attention_probs_dropout_prob == template.attention_dropout
    assert model.config.hidden_dropout_prob == own.hidden_dropout_prob  # the template keeps the model's ('model')
    for flag in ("lr", "warmup", "scheduler", "batch_size", "weight_decay", "grad_clip", "max_length", "epochs"):
        assert getattr(args, flag) == getattr(template, flag), flag


def test_study_takes_validation_time_out_of_the_clock(tmp_path):
    # 1 s per step; validations after steps 2 and 4 take 5 s each, so they show in the clock at steps 3 and 5
    rows = ["step,time,val/acc", "1,1.0,", "2,2.0,", "2,,0.6", "3,8.0,", "4,9.0,", "4,,0.8", "5,15.0,", "6,16.0,",
            "6,,0.9"]
    (tmp_path / "metrics.csv").write_text("\n".join(rows) + "\n")
    curve = study.validation_curve(tmp_path / "metrics.csv")
    assert curve["curve"] == [(2, pytest.approx(2.0), 0.6), (4, pytest.approx(4.0), 0.8), (6, pytest.approx(6.0), 0.9)]
    assert curve["train_s"] == pytest.approx(6.0)
    assert curve["final_val_acc"] == 0.9
