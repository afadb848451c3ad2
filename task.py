"""The task: everything that makes this a text-classification fine-tune of a Hugging Face model.

To train something else, replace this file; `train.py` and `fabric_utils/` only ever call the contract that
`fabric_utils/task_spec.py` writes down (`examples/` holds other tasks that satisfy it):
- `add_args`: the data and model flags
- `PRESETS`: loop defaults that a task flag brings (`--demo`'s one epoch)
- `setup`: the parsed flags -> a `TaskSpec`: tokenized train / validation / test splits (via `data/`), the
  collate function, the model builder (all of it, or LoRA adapters on a frozen model), the `ClassifierObjective`
  (forward, loss and metrics by problem type: single-label, multi-label, regression), the export (a Hugging Face
  folder that `from_pretrained` loads), each row's tokens (length grouping, tokens/s, MFU), `--lr`'s default for
  the model's width and the run's length, and what it chose for the flags it decides (what `auto` detected)

The libraries (torch, transformers, datasets) are imported inside the functions that use them, so that `--help` and
a bad flag answer before they load (seconds).
"""

from __future__ import annotations  # types are only named, never needed before the libraries load

import argparse
import contextlib
import copy
import functools
import math
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from fabric_utils.args import dropout, non_negative_int, positive_float, positive_int, probability
from fabric_utils.errors import UserError, first_line
from fabric_utils.task_spec import RowLengths, TaskSpec

# --lr's default, by the model's width (hidden size), as each entry is the widest model it covers: its peak for a
# short run, and the lowest peak a longer run falls to. Smaller encoders fine-tune at larger rates. 384 and below:
# measured on all-MiniLM-L6-v2, down to the Hugging Face Trainer's 5e-5; up to 768 (base size): the published
# DistilBERT and BERT recipes; wider (large): inside BERT's and RoBERTa-large's fine-tuning grids
LR_BY_WIDTH = ((384, 1.2e-4, 5e-5), (768, 5e-5, 5e-5), (float("inf"), 2e-5, 2e-5))
# beyond this many optimizer steps the peak falls as the square root of the run's length: a long run at a short
# run's peak can leave a small model at chance
SHORT_RUN_STEPS = 62
# LoRA trains a few small matrices, B from zero: it needs a far larger rate than full fine-tuning, but not so large
# that a draw stays at chance
LORA_LR = 2e-3
# the demo's tiny model starts from random weights: it needs a far larger learning rate than fine-tuning
DEMO_LR = 2e-3
# one epoch (200 steps) of the demo reaches test accuracy 0.99+, so it takes about a minute
PRESETS = {"demo": {"epochs": 1}}
# a small offline run that learns (test accuracy ~0.9) in 100 steps of a few milliseconds: the infrastructure tests
# (tests/infra) train whatever task.py is with its TEST_FLAGS
TEST_FLAGS = ["--demo", "--max-length", "128", "--train-size", "800", "--val-size", "48", "--test-size", "64",
              "--batch-size", "16", "--epochs", "2", "--lr", "4e-3"]
DEMO_ROOT = Path.home() / ".cache" / "fabric-template" / "demo"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--demo", action="store_true",
                        help="offline run on a synthetic dataset with a tiny model built locally (overrides "
                             "--dataset and --model)")
    g = parser.add_argument_group("data")
    g.add_argument("--dataset", default="stanfordnlp/imdb", help="hub id, local file (.parquet/.csv/.json/.jsonl) "
                   "or folder with train/validation/test files")
    g.add_argument("--text-column", default="text")
    g.add_argument("--text-pair-column", help="each row's second text, for sentence-pair tasks (NLI, paraphrase, "
                   "question-answer relevance): the two texts are tokenized as one pair, as the model expects")
    g.add_argument("--label-column", default="label")
    g.add_argument("--problem-type", choices=("auto", *HF_PROBLEM_TYPES), default="auto",
                   help="auto: from the train split's labels: lists (or strings with --label-separator) are "
                        "multi_label, numbers with fractions regression, integers and strings single_label")
    g.add_argument("--label-separator", help="multi_label: split each string label on this, e.g. ',' or '|'")
    g.add_argument("--class-weights", choices=("none", "balanced"), default="none", help="single_label: balanced "
                   "weighs each class's loss by rows / (classes x its training rows), so rare classes count as much")
    g.add_argument("--drop-invalid", action="store_true",
                   help="leave out rows with empty text, a missing or mistyped label, or a label the train split "
                        "lacks (counted per split) instead of stopping with an error")
    g.add_argument("--train-size", type=positive_int, help="use a random subset of this many training rows")
    g.add_argument("--val-size", type=positive_int, help="validation rows (carved from train if the data has none; "
                   "default 5,000 or a fifth of train)")
    g.add_argument("--test-size", type=positive_int, help="use a random subset of this many test rows")
    g.add_argument("--data-seed", type=int, help="seed that draws the subsets and carves the validation rows "
                   "(default: --seed); fix it to train with other --seeds on the same rows")
    g.add_argument("--max-length", type=positive_int, default=512, help="truncate texts to this many tokens")
    g.add_argument("--pad-to-max-length", action="store_true", help="pad every row to --max-length (slow: "
                   "most rows are shorter)")
    g.add_argument("--pad-to-multiple-of", type=positive_int, default=8,
                   help="batches are padded to a few lengths (buckets), multiples of this (tensor-core friendly) "
                        "growing by ~15%% each up to --max-length: few shapes for compiled graphs, little padding")

    g = parser.add_argument_group("model", "--lr's default follows the model's width (hidden size) and the run's "
                                  "length: " + "; ".join(f"up to {width}: {peaks(short, long)}"
                                                         for width, short, long in LR_BY_WIDTH[:-1])
                                  + f"; wider: {peaks(*LR_BY_WIDTH[-1][1:])}; with --lora-r {rate(LORA_LR)}, "
                                    f"with --demo {rate(DEMO_LR)}")
    g.add_argument("--model", default="distilbert-base-uncased", help="hub id or local folder")
    g.add_argument("--attention-dropout", type=dropout, default=0.0,
                   help="attention-probability dropout, or 'model' for the model's own; 0 skips drawing a random "
                        "mask over every attention matrix, which is slow")
    g.add_argument("--hidden-dropout", type=dropout, default="model",
                   help="hidden-state dropout, the head's too, or 'model' for the model's own")

    g = parser.add_argument_group("LoRA: train low-rank adapters and the classification head, the rest frozen")
    g.add_argument("--lora-r", type=non_negative_int, default=0,
                   help="adapter rank (8 is typical; 0 trains every weight)")
    g.add_argument("--lora-alpha", type=positive_float, help="adapter scale: updates are multiplied by alpha / r "
                   "(default 2 x r, so the scale and the right --lr stay the same when r changes)")
    g.add_argument("--lora-dropout", type=probability, default=0.0, help="dropout on the adapters' input")
    g.add_argument("--lora-target-modules", nargs="+", metavar="NAME",
                   help="names of the linear layers to adapt (default: every linear layer of attention and MLP, "
                        "found by structure for any architecture; the head trains in full)")


def setup(args: argparse.Namespace, verbose: bool) -> TaskSpec:
    """The task for these flags: checked, tokenized splits, the model builder, objective and export."""
    quiet_libraries(bars=verbose, logs=args.verbose)
    data_seed = args.seed if args.data_seed is None else args.data_seed
    if args.demo:
        from data.demo import prepare_demo

        dataset, model = map(str, prepare_demo(DEMO_ROOT))
    else:
        dataset, model = args.dataset, args.model
    data = load_data(dataset=dataset, model=model, text_column=args.text_column,
                     label_column=args.label_column, max_length=args.max_length, seed=data_seed,
                     train_size=args.train_size, val_size=args.val_size, test_size=args.test_size,
                     problem_type=args.problem_type, label_separator=args.label_separator,
                     drop_invalid=args.drop_invalid, text_pair_column=args.text_pair_column)
    objective = ClassifierObjective(data.problem_type, num_labels=len(data.label_names), label_names=data.label_names,
                                    class_weights=class_weights(args.class_weights, data))
    from data.tokenize import make_collator
    from fabric_utils.progress import say

    for note in data.notes:  # what preparing the data did that a user should know
        say(note)

    def build(weights: bool = True) -> torch.nn.Module:
        return build_model(data.model_source, data.label_names, data.problem_type,
                           attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
                           lora_r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                           lora_target_modules=args.lora_target_modules, pad_token_id=data.tokenizer.pad_token_id,
                           weights=weights)

    base = {}  # LoRA's checkpoints hold the adapters alone: a resume must build them on the same base
    if args.lora_r:
        from data.extras import weights_digest
        base = {"base model weights (SHA-256)": weights_digest(data.model_source)}

    def example_batch(rows: int, length: int | None, device) -> dict:  # only the flags that probe the model ask
        from data.extras import make_example_batch
        return make_example_batch(data.tokenizer, objective, rows, length or args.max_length, device)

    return TaskSpec(
        datasets={name: split.remove_columns("length").with_format("torch") for name, split in data.splits.items()},
        collate=make_collator(data.tokenizer, args.pad_to_max_length, args.max_length, args.pad_to_multiple_of),
        build_model=build, build_skeleton=lambda: build(weights=False), objective=objective,
        example_batch=example_batch,
        export=lambda weights, model, folder: export(weights, model, data.tokenizer, folder),
        # the demo's model is a cache in each node's own HOME: its folder differs from node to node
        fingerprint={"model": "--demo" if args.demo else data.model_source, "labels": data.label_names,
              "problem_type": data.problem_type, "--dataset": "--demo" if args.demo else dataset,
              "--max-length": args.max_length, "--train-size": args.train_size, "--data-seed": data_seed,
              **({"--class-weights": args.class_weights} if args.class_weights != "none" else {}),
              **base},
        # [:] reads a column whole: a datasets Column read row by row takes seconds on 25,000 rows
        lengths=RowLengths(per_split={name: split["length"][:] for name, split in data.splits.items()},
                           in_batch=row_lengths, longest=args.max_length, padded_to=padded_length),
        chance_loss={name: objective.chance_loss(data.splits[name]["labels"][:],
                                                 fitted_on=data.splits["train"]["labels"][:])
                     for name in ("train", "validation")},
        default_lr=lambda steps: learning_rate_for(load_model_config(data.model_source), steps, lora=bool(args.lora_r),
                                                   demo=args.demo),
        # config.yaml and results.json record what the run trained: the demo's data and model, the draw, what auto
        # chose
        decided_flags={"dataset": dataset, "model": model, "data_seed": data_seed, "problem_type": data.problem_type})


def class_weights(choice: str, data: TaskData) -> tuple[float, ...] | None:
    """--class-weights balanced: each class's weight, rows / (classes x the class's training rows), as scikit-learn's
    "balanced" (a class the train split lacks is refused when the data is read); None for none."""
    if choice == "none":
        return None
    if data.problem_type != "single_label":
        raise UserError(f"--class-weights {choice} is for single_label tasks; this one is {data.problem_type}")
    counts = Counter(data.splits["train"]["labels"][:])
    rows, classes = sum(counts.values()), len(data.label_names)
    weights = tuple(rows / (classes * counts[label]) for label in range(classes))
    data.notes.append("--class-weights balanced: " + ", ".join(f"{name} {weight:.3g}"
                                                               for name, weight in zip(data.label_names, weights)))
    return weights


@functools.cache
def weights_on(weights: tuple[float, ...], device) -> torch.Tensor:
    """The class weights as a tensor on ``device``, made once: not a host-to-device copy every step."""
    import torch

    return torch.tensor(weights, device=device)


def quiet_libraries(bars: bool, logs: bool) -> None:
    """datasets' progress bars (tokenizing a large dataset takes a while) only where wanted (``bars``); transformers'
    bars (loading and writing a model: a blink) and both libraries' logs only with ``logs`` (--verbose):
    transformers' load report lists the fresh classification head as missing, as fine-tuning expects, datasets
    logs a file it cannot read before raising the error that stops the run in one line, and peft reads a property
    transformers warns is deprecated on every model it adds LoRA to."""
    import datasets
    import transformers

    if not bars:
        datasets.disable_progress_bars()
    if not logs:
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        # peft adapts GPT-2's Conv1D layers (weights stored transposed) the right way, and says so
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False", category=UserWarning)


# ---- data ------------------------------------------------------------------------------------------------------------
@dataclass
class TaskData:
    splits: datasets.DatasetDict  # tokenized train / validation / test, with a "length" column per row
    label_names: list[str]  # class names in id order; for regression, the one output's name
    problem_type: str  # single_label, multi_label or regression
    tokenizer: object
    model_source: str  # --model, or the demo's model folder
    notes: list[str]  # what the loading did that a user should know (rows --drop-invalid left out)


def load_data(dataset: str, model: str, text_column: str, label_column: str, max_length: int,
              seed: int, train_size=None, val_size=None, test_size=None, problem_type="auto", label_separator=None,
              drop_invalid=False, text_pair_column=None) -> TaskData:
    """Rows -> checked, labelled, tokenized splits (tokenization is cached by the data's fingerprint, the tokenizer,
    the text columns and max_length). Bad rows stop the run with a UserError naming them, or are dropped with
    ``drop_invalid``. With ``text_pair_column`` each row is a sentence pair."""
    from data.sources import load_splits
    from data.tokenize import tokenize_splits

    data = load_splits(dataset, text_column, label_column, seed, train_size, val_size, test_size,
                       problem_type=problem_type, label_separator=label_separator, drop_invalid=drop_invalid,
                       text_pair_column=text_pair_column)
    tokenizer = load_tokenizer(model)
    check_positions(load_model_config(model), tokenizer, max_length, model)
    padding = pad_with_end_token(tokenizer, model)
    tokenized = tokenize_splits(data.splits, tokenizer, text_column, max_length, text_pair_column)
    return TaskData(tokenized, data.label_names, data.problem_type, tokenizer, model, data.drop_report() + padding)


def _check_source(source: str) -> None:
    """An existing folder, or a hub id the hub can give (data/extras.py): without network and without the model, the run
    stops here at once."""
    if not Path(source).expanduser().exists():
        from data.extras import check_hub_model
        check_hub_model(source)


def load_tokenizer(source: str):
    from transformers import AutoTokenizer

    _check_source(source)
    try:
        return AutoTokenizer.from_pretrained(source, use_fast=True, trust_remote_code=False)
    except OSError as err:
        raise UserError(f"cannot load a tokenizer from {source!r}: {first_line(err)}") from err


def check_positions(config, tokenizer, max_length: int, source: str) -> None:
    """--max-length within the model's positions (``max_position_embeddings``, GPT-2's ``n_positions``), or the
    tokenizer's ``model_max_length`` where it is lower (RoBERTa's positions start after its pad id): beyond them the
    first long row would fail deep inside the model. Models of relative positions only (T5) name no limit."""
    limits = [getattr(config, "max_position_embeddings", None), tokenizer.model_max_length]
    limit = min((n for n in limits if isinstance(n, int) and 0 < n < 10**9), default=None)  # huge: unset
    if limit is not None and limits[0] is not None and max_length > limit:
        raise UserError(f"--max-length {max_length} is beyond the {limit} positions of model {source}: pass "
                        f"--max-length {limit} or less")


def pad_with_end_token(tokenizer, source: str) -> list[str]:
    """A tokenizer without a pad token (decoders: GPT-2, Llama, Mistral) pads with its end-of-text token, else its
    unknown one, as transformers' docs do for classification; the model pools each row's last token that is not this
    one, for either padding side. Returns the note that says so, or none where the tokenizer has its own."""
    if tokenizer.pad_token is not None:
        return []
    token = tokenizer.eos_token or tokenizer.unk_token
    if token is None:
        raise UserError(f"the tokenizer of {source} has no pad, end-of-text or unknown token to pad batches with: "
                        f"give it a pad_token in its tokenizer_config.json")
    tokenizer.pad_token = token
    return [f"padding with {token!r} (id {tokenizer.pad_token_id}), as the tokenizer has no pad token; the model's "
            f"config names it too, so a decoder pools each row's last token that is not it"]


# ---- model -----------------------------------------------------------------------------------------------------------
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
HF_PROBLEM_TYPES = {"single_label": "single_label_classification", "multi_label": "multi_label_classification",
                    "regression": "regression"}


def load_model_config(source: str):
    from transformers import AutoConfig

    _check_source(source)
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=False)
    except OSError as err:
        raise UserError(f"cannot load model {source!r}: {first_line(err)}") from err


def rate(lr: float) -> str:
    """A learning rate as --help writes it: 1.2e-4, 5e-5."""
    return f"{lr:.1e}".replace(".0e", "e").replace("e-0", "e-")


def peaks(short: float, long: float) -> str:
    """A width's default peaks as --help writes them."""
    return rate(short) if short == long else (f"{rate(short)}, x sqrt({SHORT_RUN_STEPS} / steps) beyond "
                                              f"{SHORT_RUN_STEPS} optimizer steps, at least {rate(long)}")


def learning_rate_for(config, steps: int, lora: bool = False, demo: bool = False) -> float:
    """--lr's default for a run of ``steps`` optimizer steps: LoRA's, the demo's, else the peak for a model of this
    width (``LR_BY_WIDTH``; the base-size one if the config names no hidden size) and a run this long."""
    if lora:
        return LORA_LR
    if demo:
        return DEMO_LR
    width = getattr(config, "hidden_size", None) or 768
    short, long = next((short, long) for widest, short, long in LR_BY_WIDTH if width <= widest)
    return max(long, short * min(1.0, math.sqrt(SHORT_RUN_STEPS / steps)))


def build_model(source: str, label_names: list[str], problem_type: str, attention_dropout: float | None,
                hidden_dropout: float | None, lora_r: int = 0,
                lora_alpha: float | None = None, lora_dropout: float = 0.0,
                lora_target_modules: list[str] | None = None, pad_token_id: int | None = None,
                weights: bool = True) -> torch.nn.Module:
    """The pretrained encoder with a fresh head for ``label_names`` (never running remote code). Its config carries
    the problem type and the label names, so the exported model predicts the right way (softmax, sigmoid or a
    number), and the tokenizer's ``pad_token_id``, by which decoders find each row's last token (Qwen2's config names
    none though its tokenizer pads). A dropout of None keeps the model's own. ``lora_r`` > 0 freezes it and adds LoRA
    adapters (data/extras.py). The weights keep the dtype the folder holds (transformers memory-maps its safetensors
    file): the loop makes them fp32, under fsdp2 once each rank holds only its shards, so no rank converts the whole.
    Without ``weights``, the same model in fp32 with no weight read or initialized: the skeleton that the loop builds
    sharded under fsdp, fsdp2 and ZeRO-3 and fills from the pretrained model on rank 0."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers.initialization import no_init_weights

    config = load_model_config(source)
    trained_labels = list(config.id2label.values()) if config.architectures and any(
        a.endswith("ForSequenceClassification") for a in config.architectures) else None
    if trained_labels and len(trained_labels) != len(label_names):
        raise UserError(f"model {source} classifies {len(trained_labels)} labels {trained_labels} but the data has "
                        f"{len(label_names)} {label_names}; use a base model or matching data")
    overrides = {}
    # each family names them its own way (BERT, DistilBERT and BART, GPT-2, T5, ModernBERT): set the ones it has
    if attention_dropout is not None:
        overrides.update(dict.fromkeys(("attention_probs_dropout_prob", "attention_dropout", "attn_pdrop"),
                                       attention_dropout))
    if hidden_dropout is not None:
        overrides.update(dict.fromkeys(("hidden_dropout_prob", "dropout", "activation_dropout", "resid_pdrop",
                                        "embd_pdrop", "dropout_rate", "mlp_dropout", "embedding_dropout",
                                        "classifier_dropout", "seq_classif_dropout"), hidden_dropout))
    pad = {} if pad_token_id is None else {"pad_token_id": pad_token_id}
    overrides["use_cache"] = False  # a classifier never generates; a block recomputed under FSDP would fill it twice
    config = AutoConfig.from_pretrained(
        source, num_labels=len(label_names), id2label=dict(enumerate(label_names)),
        label2id={name: i for i, name in enumerate(label_names)}, problem_type=HF_PROBLEM_TYPES[problem_type],
        trust_remote_code=False, **pad, **{k: v for k, v in overrides.items() if hasattr(config, k)})
    # the skeleton's initializers would write into weights that hold no memory (meta) or a ZeRO-3 partition
    with contextlib.nullcontext() if weights else no_init_weights():
        if weights:
            model = AutoModelForSequenceClassification.from_pretrained(source, config=config, dtype="auto",
                                                                       trust_remote_code=False)
        else:  # fp32, not the dtype the config names (the file's)
            model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32,
                                                                   trust_remote_code=False)
        if lora_r:
            from data.extras import add_lora
            model = add_lora(model, r=lora_r, alpha=lora_alpha or 2 * lora_r, dropout=lora_dropout,
                             target_modules=lora_target_modules, upcast=weights)
    return model.train()  # from_pretrained returns eval mode: dropout would stay off


# ---- forward, loss, metrics: shared by training and evaluation -------------------------------------------------------
@dataclass
class ClassifierObjective:
    """What training minimizes and evaluation reports, by problem type: single_label (softmax cross-entropy,
    accuracy), multi_label (sigmoid binary cross-entropy, micro-F1 and exact match at 0.5) or regression (mean
    squared error, RMSE and Pearson correlation). ``best_metric`` picks checkpoints/best."""
    problem_type: str
    num_labels: int
    label_names: list[str] | None = None  # in id order: the predictions files name each label beside its id
    class_weights: tuple[float, ...] | None = None  # single_label: each class's weight in the loss (--class-weights)

    def forward(self, model, batch: dict) -> torch.Tensor:
        """Logits: (rows, labels), or (rows,) for a one-output regression head."""
        # only the inputs the batch has: token_type_ids come with sentence pairs for the models that take them
        # (DistilBERT's forward has no such argument), an attention mask only where the batch has padding
        logits = model(**{name: batch[name] for name in MODEL_INPUTS if name in batch}).logits
        return logits.squeeze(-1) if logits.shape[-1] == 1 else logits

    @property
    def best_metric(self) -> str:
        return {"single_label": "acc", "multi_label": "f1", "regression": "rmse"}[self.problem_type]

    @property
    def higher_is_better(self) -> bool:
        return self.problem_type != "regression"

    def loss(self, logits: torch.Tensor, batch: dict, reduction: str = "mean") -> torch.Tensor:
        """One loss per row with ``reduction="none"`` (evaluation averages rows exactly), else their mean."""
        import torch.nn.functional as F

        logits, labels = logits.float(), batch["labels"]
        if self.problem_type == "single_label":
            weight = None if self.class_weights is None else weights_on(self.class_weights, logits.device)
            return F.cross_entropy(logits, labels, weight=weight, reduction=reduction)
        per_value = (F.binary_cross_entropy_with_logits if self.problem_type == "multi_label" else F.mse_loss)(
            logits, labels.float(), reduction="none")
        per_row = per_value.mean(dim=-1) if per_value.ndim > 1 else per_value
        return per_row if reduction == "none" else per_row.mean()

    def make_metrics(self) -> MetricCollection:
        """Updated on the device every batch, read (and summed over ranks) only by ``compute()``. ``validate_args``
        off: its checks read values back to the host on every update."""
        from torchmetrics import MetricCollection
        from torchmetrics.classification import MulticlassAccuracy, MultilabelExactMatch, MultilabelF1Score
        from torchmetrics.regression import MeanSquaredError, PearsonCorrCoef

        k = self.num_labels
        return MetricCollection({
            "single_label": lambda: {"acc": MulticlassAccuracy(k, average="micro", validate_args=False)},
            "multi_label": lambda: {"f1": MultilabelF1Score(k, average="micro", validate_args=False),
                                    "exact_match": MultilabelExactMatch(k, validate_args=False)},
            "regression": lambda: {"rmse": MeanSquaredError(squared=False), "pearson": PearsonCorrCoef()},
        }[self.problem_type]())

    def is_better(self, value: float, best: float | None) -> bool:
        return best is None or (value > best if self.higher_is_better else value < best)

    def chance_loss(self, labels, fitted_on) -> float:
        """The loss on ``labels`` of the best output that ignores the inputs, fitted on the labels ``fitted_on``: their
        class shares (single_label; each label's share for multi_label) or their mean (regression). On the rows it
        was fitted on, that is their entropy or their variance."""
        import torch

        labels, fitted_on = torch.as_tensor(labels).double(), torch.as_tensor(fitted_on).double()
        if self.problem_type == "regression":
            return (labels - fitted_on.mean(dim=0)).square().mean().item()
        if self.problem_type == "single_label":  # with class weights w, the best output is the shares times w
            p, q = (torch.bincount(y.long(), minlength=self.num_labels) / len(y) for y in (fitted_on, labels))
            w = torch.tensor(self.class_weights or [1.0] * self.num_labels, dtype=torch.double)
            return -(q * w * (p * w / (p * w).sum()).log()).nan_to_num().sum().item()  # nan_to_num: 0 log 0 is 0
        p, q = fitted_on.mean(dim=0), labels.mean(dim=0)  # each label's share of the rows
        return -(q * p.log() + (1 - q) * (1 - p).log()).nan_to_num().mean().item()

    def predict(self, logits: torch.Tensor, batch: dict) -> dict[str, torch.Tensor]:
        """Each row's label (where the batch has labels), prediction and score, as the metrics see them: the class
        of the largest logit and its probability (single_label); each label of probability above 0.5, and each one's
        probability (multi_label); the predicted value (regression)."""
        logits = logits.float()
        label = {"label": batch["labels"]} if "labels" in batch else {}  # new rows to predict have none
        if self.problem_type == "single_label":
            probabilities = logits.softmax(dim=-1)
            score, predicted = probabilities.max(dim=-1)
            return {**label, "predicted": predicted, "score": score, "probabilities": probabilities}
        if self.problem_type == "multi_label":
            score = logits.sigmoid()
            return {**{k: v.int() for k, v in label.items()}, "predicted": (score > 0.5).int(), "score": score}
        return {**label, "predicted": logits}

    def table(self, columns: dict) -> dict[str, list]:
        """``predict``'s columns (gathered: every row's) as the predictions files show them: each label's name after
        its id (multi_label: the names of the labels on, comma-separated) and a probability per class, named."""
        probabilities = columns.pop("probabilities", None)
        if self.problem_type == "multi_label":
            probabilities = columns["score"]
        table = {}
        for name, column in columns.items():
            table[name] = column.tolist()
            if name in ("label", "predicted") and self.label_names and self.problem_type != "regression":
                table[f"{name}_name"] = [self.name_of(value) for value in table[name]]
        if probabilities is not None and self.label_names:
            table.update({f"score_{name}": probabilities[:, i].tolist() for i, name in enumerate(self.label_names)})
        return table

    def name_of(self, value) -> str:
        if self.problem_type == "multi_label":
            return ",".join(name for name, on in zip(self.label_names, value) if on)
        return self.label_names[value]


def row_lengths(batch: dict) -> torch.Tensor:
    """Tokens per row that are not padding, from the batch on the host (no device read): what throughput
    (tokens/s) and MFU count. A batch without a mask has no padding."""
    import torch

    if "attention_mask" in batch:
        return batch["attention_mask"].sum(dim=1)
    rows, length = batch["input_ids"].shape
    return torch.full((rows,), length)


def padded_length(batch: dict) -> int:
    return batch["input_ids"].shape[1]


# ---- predictions on new rows: predict.py --------------------------------------------------------------------------
def predict(folder: Path, source: Path, flags: dict, batch_size: int) -> dict[str, list]:
    """The exported model's (``folder``) predictions for each row of the file ``source``, read as the run that trained
    it read its data (``flags``: its config.yaml): data/extras.py, imported only then."""
    from data.extras import predict_file

    return predict_file(folder, source, flags, batch_size)


# ---- export ----------------------------------------------------------------------------------------------------------
def export(state_dict: dict, trained, tokenizer, out: Path) -> None:
    """Writes a Hugging Face folder (weights, config with label names, tokenizer) into ``out``: ``state_dict`` into
    a fresh copy of the ``trained`` model's architecture (its own weights may be sharded). LoRA adapters are merged
    into the weights they adapt, so the folder loads with plain ``from_pretrained``, without peft."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_config(trained.config)
    lora = getattr(trained, "peft_config", None)  # set on a peft model
    if lora:
        from peft import get_peft_model
        model = get_peft_model(model, copy.deepcopy(lora["default"]))
    model.load_state_dict(state_dict, strict=True)
    if lora:
        model = model.merge_and_unload()
    # the stock classes trained it: a source model's pointers to its own code (auto_map) stay behind
    model.config.__dict__.pop("auto_map", None)
    tokenizer.init_kwargs.pop("auto_map", None)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
