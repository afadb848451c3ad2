"""The Hugging Face ``Trainer`` peer of train.py for the speed benchmark: same model (built by the template's own
``task.build_model``, so with the same attention and hidden dropout), data subset, seed, learning rate, batch size, epochs,
schedule, weight decay and clipping, all defaulting to train.py's defaults (the task's rate for the model); dynamic
padding and length grouping. ``--own-defaults`` trains with the Trainer's own defaults instead (``TrainingArguments``'
learning rate 5e-5, linear decay to 0 without warm-up, no weight decay, clipping at 1.0, no length grouping, the
model's own dropout): the peer a user who picks the Trainer gets. The batch size stays --batch-size.
Single texts or sentence pairs (--text-pair-column), single-label, multi-label or regression labels, full fine-tuning
or LoRA (--lora-r, the template's adapters), as train.py reads them.

Writes ``results.json`` with the keys run_bench.py reads from train.py's results (``mfu`` is not measured here).
The training clock is the sum of the epochs' own times (data loading and steps), so the validation and the checkpoint
after each epoch are not in it, as train.py's throughput clock leaves out its validations and checkpoints.

It is the text task's own peer, so it imports task.py's and data/'s internals (the model builder, the objective, the
learning-rate rule, loading and tokenizing): it runs while task.py is the text task as shipped. The rest of bench/
reaches a task through the contract (fabric_utils/task_spec.py) or through train.py's flags.
"""

import argparse
import json
import math
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
from task import ClassifierObjective, learning_rate_for, load_model_config  # noqa: E402
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
    for flag in ("text_column", "text_pair_column", "label_column", "problem_type", "label_separator", "lora_r"):
        p.add_argument(f"--{flag.replace('_', '-')}", default=TEMPLATE.get_default(flag))
    p.add_argument("--own-defaults", action="store_true", help="the Trainer's own optimizer, schedule, clipping, "
                   "sampler and dropout defaults instead of train.py's (the rate, schedule and dropout flags are "
                   "ignored)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--torch-compile", action="store_true", help="the Trainer's own torch.compile (torch_compile)")
    p.add_argument("--num-workers", type=int, default=0)
    return p.parse_args(argv)


def build_model(model: str, label_names: list[str], attention_dropout, hidden_dropout, problem_type="single_label",
                lora_r=0):
    """The template's own model building, so both rows train the same network (dropout and adapters included)."""
    return build_template_model(model, label_names, problem_type, attention_dropout=attention_dropout,
                                hidden_dropout=hidden_dropout, lora_r=int(lora_r))


def metrics_for(problem_type: str):
    """compute_metrics with train.py's metric names: accuracy; micro-F1 and exact match at 0.5; RMSE and Pearson."""
    def compute(pred):
        logits, labels = np.asarray(pred.predictions, dtype=np.float64), np.asarray(pred.label_ids)
        if problem_type == "single_label":
            return {"acc": float((logits.argmax(axis=-1) == labels).mean())}
        if problem_type == "multi_label":
            predicted, labels = logits > 0, labels > 0.5  # a logit above 0 is a probability above 0.5
            true_pos = (predicted & labels).sum()
            return {"f1": float(2 * true_pos / max(predicted.sum() + labels.sum(), 1)),
                    "exact_match": float((predicted == labels).all(axis=-1).mean())}
        logits = logits.reshape(len(labels))
        return {"rmse": float(np.sqrt(((logits - labels) ** 2).mean())),
                "pearson": float(np.corrcoef(logits, labels)[0, 1])}
    return compute


def own_defaults(out_dir: str) -> dict:
    """The TrainingArguments defaults that train.py's flags would otherwise set."""
    from transformers import TrainingArguments

    d = TrainingArguments(output_dir=out_dir)
    return {"learning_rate": d.learning_rate, "weight_decay": d.weight_decay, "max_grad_norm": d.max_grad_norm,
            "lr_scheduler_type": d.lr_scheduler_type, "lr_scheduler_kwargs": d.lr_scheduler_kwargs,
            "warmup_steps": d.warmup_steps, "train_sampling_strategy": d.train_sampling_strategy}


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
    data = load_splits(args.dataset, args.text_column, args.label_column, seed=args.seed, train_size=args.train_size,
                       val_size=args.val_size, test_size=args.test_size, problem_type=args.problem_type,
                       label_separator=args.label_separator, text_pair_column=args.text_pair_column)
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=False)
    tokenized = tokenize_splits(data.splits, tokenizer, args.text_column, args.max_length,  # keeps a "length" column
                                args.text_pair_column)
    dropouts = (None, None) if args.own_defaults else (args.attention_dropout, args.hidden_dropout)
    model = build_model(args.model, data.label_names, *dropouts, problem_type=data.problem_type, lora_r=args.lora_r)

    if args.own_defaults:
        optimization = own_defaults(args.out_dir)
    else:
        steps = args.epochs * math.ceil(len(tokenized["train"]) / args.batch_size)
        lr = args.lr or learning_rate_for(load_model_config(args.model), steps, lora=bool(args.lora_r))  # as train.py
        scheduler, scheduler_kwargs = HF_SCHEDULERS[args.scheduler]
        optimization = {"learning_rate": lr, "weight_decay": args.weight_decay, "max_grad_norm": args.grad_clip,
                        "lr_scheduler_type": scheduler, "lr_scheduler_kwargs": scheduler_kwargs(lr, args.min_lr_rate),
                        "warmup_steps": args.warmup, "train_sampling_strategy": "group_by_length"}
    objective = ClassifierObjective(data.problem_type, len(data.label_names))
    training_args = TrainingArguments(
        output_dir=args.out_dir, use_cpu=not torch.cuda.is_available(), seed=args.seed, bf16=args.bf16,
        torch_compile=args.torch_compile,
        num_train_epochs=args.epochs, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=2 * args.batch_size, **optimization, length_column_name="length",
        dataloader_num_workers=args.num_workers, eval_strategy="epoch", save_strategy="epoch", save_total_limit=1,
        load_best_model_at_end=True, metric_for_best_model=objective.best_metric,
        greater_is_better=objective.higher_is_better, logging_strategy="no", report_to="none", disable_tqdm=True)
    clock = epoch_clock()
    trainer = Trainer(model=model, args=training_args, train_dataset=tokenized["train"],
                      eval_dataset=tokenized["validation"], processing_class=tokenizer,
                      data_collator=DataCollatorWithPadding(tokenizer), compute_metrics=metrics_for(data.problem_type),
                      callbacks=[clock])
    trainer.train()
    train_time = clock.seconds
    val = trainer.evaluate()
    test = trainer.evaluate(tokenized["test"], metric_key_prefix="test")
    results = {
        **{f"val_{k[len('eval_'):]}": v for k, v in val.items() if k.startswith("eval_")},
        **{k: v for k, v in test.items() if k.startswith("test_")}, "test_examples": len(tokenized["test"]),
        "train_examples": len(tokenized["train"]), "precision": "bf16-mixed" if args.bf16 else "32-true",
        "train_time_s": train_time, "steps": trainer.state.global_step,
        "train_samples_per_s": args.epochs * len(tokenized["train"]) / train_time,
        "train_tokens_per_s": args.epochs * sum(tokenized["train"]["length"]) / train_time,
        "mfu": None, "config": vars(args),
    }
    (Path(args.out_dir) / "results.json").write_text(json.dumps(results, indent=2))
    metric = objective.best_metric
    print(f"test {metric} {results[f'test_{metric}']:.4f}; results in {args.out_dir}/results.json")


if __name__ == "__main__":
    main()
