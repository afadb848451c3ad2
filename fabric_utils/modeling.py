"""Load the tokenizer and the classification model from a hub id or a local folder (never running remote code)."""

from pathlib import Path

from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from fabric_utils.errors import UserError
from fabric_utils.launcher import strategy_checkpoints_blocks


def _check_source(source: str) -> None:
    if source.startswith((".", "/", "~")) and not Path(source).expanduser().exists():
        raise UserError(f"model path {source} does not exist (pass a hub id or an existing folder to --model)")


def load_tokenizer(source: str):
    _check_source(source)
    try:
        return AutoTokenizer.from_pretrained(source, use_fast=True, trust_remote_code=False)
    except OSError as err:
        raise UserError(f"cannot load a tokenizer from {source!r}: {str(err).splitlines()[0]}") from err


def load_model(args, label_names: list[str]):
    """The pretrained encoder with a classification head for ``label_names``, with the dropout and memory
    settings of ``args`` applied."""
    _check_source(args.model)
    overrides = {}
    if args.attention_dropout is not None:  # BERT-style and DistilBERT-style configs name these differently
        overrides.update(attention_probs_dropout_prob=args.attention_dropout, attention_dropout=args.attention_dropout)
    if args.hidden_dropout is not None:
        overrides.update(hidden_dropout_prob=args.hidden_dropout, dropout=args.hidden_dropout)
    try:
        config = AutoConfig.from_pretrained(args.model, trust_remote_code=False)
    except OSError as err:
        raise UserError(f"cannot load model {args.model!r}: {str(err).splitlines()[0]}") from err
    trained_labels = list(config.id2label.values()) if config.architectures and any(
        a.endswith("ForSequenceClassification") for a in config.architectures) else None
    if trained_labels and len(trained_labels) != len(label_names):
        raise UserError(f"model {args.model} classifies {len(trained_labels)} labels {trained_labels} but the data has "
                        f"{len(label_names)} {label_names}; use a base model or matching data")
    overrides = {k: v for k, v in overrides.items() if hasattr(config, k)}
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model, num_labels=len(label_names), id2label=dict(enumerate(label_names)),
        label2id={name: i for i, name in enumerate(label_names)}, trust_remote_code=False, **overrides)
    if args.grad_checkpointing and not strategy_checkpoints_blocks(args):  # FSDP wraps the blocks itself
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.compile:
        model = _compile(model, args.compile_mode)
    return model


def _compile(model, mode: str):
    import torch

    # lengths vary per batch: one dynamic-shape graph instead of a recompile per padded length
    model.forward = torch.compile(model.forward, mode=mode, dynamic=True)
    return model
