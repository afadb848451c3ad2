"""The benchmark scripts' own logic: the Trainer row's model settings."""

import sys
from pathlib import Path

from data.demo import prepare_demo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import hf_trainer  # noqa: E402
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
    for flag in ("lr", "warmup", "scheduler", "min_lr_rate", "batch_size", "weight_decay", "grad_clip", "max_length",
                 "epochs"):
        assert getattr(args, flag) == getattr(template, flag), flag
