"""The Hugging Face ``Trainer`` peer of train.py for the speed benchmark: same model (built by the template's own
``task.build_model``, so with the same attention and hidden dropout), data subset, seed, learning rate, batch size, epochs,
schedule, weight decay and clipping, all defaulting to train.py's defaults (the task's rate for the model); dynamic
padding and length grouping.

Writes ``results.json`` with the keys run_bench.py reads from train.py's results (``mfu`` is not measured here).
The training clock is the sum of the epochs' own times (data loading and steps), so the validation and the checkpoint
after each epoch are not in it, as train.py's throughput clock leaves out its validations and checkpoints.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the template's data package: the identical subset

from data.sources import load_splits  # noqa: E402
from data.tokenize import tokenize_splits  # noqa: E402
from fabric_utils.args import dropout  # noqa: E402
from task import build_model as build_template_model  # noqa: E402
from task import learning_rate_for, load_model_config  # noqa: E402
from train import flag_parser  # noqa: E402

TEMPLATE = flag_parser()
# train.py's --scheduler as transformers' get_scheduler name, and its arguments for a peak rate and --min-lr-rate
# (where the decay ends): a linear decay to a floor is transformers' polynomial decay of power 1. one-cycle has no
# Trainer peer
HF_SCHEDULERS = {
    "linear": ("polynomial", lambda lr, min_lr_rate: {"lr_end": min_lr_rate * lr, "power": 1.0}),
    "cosine": ("cosine_with_min_lr", lambda lr, min_lr_rate: {"min_lr_rate": min_lr_rate}),
    "constant": ("constant_with_warmup", lambda lr, min_lr_rate: {}),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dataset", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--train-size", type=int)
    p.add_argument("--val-size", type=int)
    p.add_argument("--test-size", type=int)
    for flag in ("max_length", "epochs", "batch_size"):
        p.add_argument(f"--{flag.replace('_', '-')}", type=int, default=TEMPLATE.get_default(flag))
    for flag in ("lr", "weight_decay", "grad_clip", "min_lr_rate"):
        p.add_argument(f"--{flag.replace('_', '-')}", type=float, default=TEMPLATE.get_default(flag))
    p.add_argument("--warmup", type=float, default=TEMPLATE.get_default("warmup"),
                   help="a fraction of all steps if below 1 (transformers rounds it up), else a step count")
    p.add_argument("--scheduler", choices=tuple(HF_SCHEDULERS), default=TEMPLATE.get_default("scheduler"))
    p.add_argument("--attention-dropout", type=dropout, default=TEMPLATE.get_default("attention_dropout"))
    p.add_argument("--hidden-dropout", type=dropout, default=TEMPLATE.get_default("hidden_dropout"))
    p.add_argument("--seed", type=int, default=TEMPLATE.get_default("seed"))
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--num-workers", type=int, default=0)
    return p.parse_args(argv)


def build_model(model: str, label_names: list[str], attention_dropout, hidden_dropout):
    """The template's own model building, so both rows train the same network (dropout included)."""
    return build_template_model(model, label_names, "single_label", attention_dropout=attention_dropout,
                                hidden_dropout=hidden_dropout)


def epoch_clock():
    """A Trainer callback that adds up the time from each epoch's start to its end, before its evaluation."""
    from transformers import TrainerCallback

    class EpochClock(TrainerCallback):
        seconds, _start = 0.0, None

        def on_epoch_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_epoch_end(self, args, state, control, **kwargs):
            self.seconds += time.perf_counter() - self._start

    return EpochClock()


def main(argv=None):
    args = parse_args(argv)
    from transformers import AutoTokenizer, DataCollatorWithPadding, Trainer, TrainingArguments, set_seed

    set_seed(args.seed)
    data = load_splits(args.dataset, seed=args.seed, train_size=args.train_size, val_size=args.val_size,
                       test_size=args.test_size)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenized = tokenize_splits(data.splits, tokenizer, "text", args.max_length)  # keeps a "length" column
    model = build_model(args.model, data.label_names, args.attention_dropout, args.hidden_dropout)

    lr = args.lr or learning_rate_for(load_model_config(args.model))  # as train.py's task chooses it
    scheduler, scheduler_kwargs = HF_SCHEDULERS[args.scheduler]

    def accuracy(pred):
        return {"accuracy": float((np.argmax(pred.predictions, axis=-1) == pred.label_ids).mean())}

    training_args = TrainingArguments(
        output_dir=args.out_dir, use_cpu=not torch.cuda.is_available(), seed=args.seed, bf16=args.bf16,
        num_train_epochs=args.epochs, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=2 * args.batch_size, learning_rate=lr, weight_decay=args.weight_decay,
        lr_scheduler_type=scheduler, lr_scheduler_kwargs=scheduler_kwargs(lr, args.min_lr_rate),
        warmup_steps=args.warmup, max_grad_norm=args.grad_clip,
        train_sampling_strategy="group_by_length", length_column_name="length",
        dataloader_num_workers=args.num_workers, eval_strategy="epoch", save_strategy="epoch", save_total_limit=1,
        load_best_model_at_end=True, metric_for_best_model="accuracy", logging_strategy="no", report_to="none",
        disable_tqdm=True)
    clock = epoch_clock()
    trainer = Trainer(model=model, args=training_args, train_dataset=tokenized["train"],
                      eval_dataset=tokenized["validation"], processing_class=tokenizer,
                      data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=accuracy, callbacks=[clock])
    trainer.train()
    train_time = clock.seconds
    val = trainer.evaluate()
    test = trainer.evaluate(tokenized["test"], metric_key_prefix="test")
    results = {
        "val_acc": val["eval_accuracy"], "test_acc": test["test_accuracy"], "test_examples": len(tokenized["test"]),
        "train_examples": len(tokenized["train"]), "precision": "bf16-mixed" if args.bf16 else "32-true",
        "train_time_s": train_time, "steps": trainer.state.global_step,
        "train_samples_per_s": args.epochs * len(tokenized["train"]) / train_time,
        "train_tokens_per_s": args.epochs * sum(tokenized["train"]["length"]) / train_time,
        "mfu": None, "config": vars(args),
    }
    (Path(args.out_dir) / "results.json").write_text(json.dumps(results, indent=2))
    print(f"test accuracy {results['test_acc']:.4f}; results in {args.out_dir}/results.json")


if __name__ == "__main__":
    main()
