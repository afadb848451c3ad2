"""The training loop's flags, grouped by purpose, and their parsing. ``--config FILE`` (YAML) sets defaults; flags on
the command line win. The task's own flags (data, model) are added by ``task.add_args``."""

import argparse
import os

import yaml

from fabric_utils.errors import UserError
from fabric_utils.launcher import add_launch_args
from fabric_utils.loggers import LOGGER_NAMES


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be zero or a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be zero or positive, got {text}")
    return value


def probability(text: str) -> float:
    """A dropout rate: in [0, 1)."""
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def dropout(text: str):
    """A probability, or "model" (None): keep what the model's config says."""
    return None if text == "model" else probability(text)


def batch_size(text: str):
    return "auto" if text == "auto" else positive_int(text)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, but not "None" for flags whose default is explained in their help."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser(description: str) -> argparse.ArgumentParser:
    """The flags of the training loop, whatever the task: launch, optimization, speed, checkpoints and logging.
    The task adds its own (data, model) to the parser this returns."""
    p = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    p.add_argument("--config", help="YAML file of flag values (as written to config.yaml); flags given here win")
    add_launch_args(p)

    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=positive_int, default=3)
    g.add_argument("--max-steps", type=positive_int, help="stop after this many optimizer steps (overrides --epochs)")
    g.add_argument("--batch-size", type=batch_size, default=16,
                   help="rows per device per micro-batch, or auto: the largest that fits")
    g.add_argument("--eval-batch-size", type=positive_int, help="rows per device when evaluating (default 2x batch)")
    g.add_argument("--grad-accum", type=positive_int, default=1,
                   help="micro-batches per optimizer step; DDP, FSDP and ZeRO-1 reduce gradients only on the last, "
                        "ZeRO-2/3 on every one (they keep only their shard)")
    g.add_argument("--lr", type=positive_float, default=1.5e-4,
                   help="peak learning rate. 1.5e-4: in one-epoch fine-tunes of all-MiniLM-L6-v2 it beat 2e-4 on "
                        "2,000 IMDB rows (0.829 against 0.809 test acc; the article's fixed 5e-5: 0.843) and on 600 "
                        "(0.775 against 0.763; article 0.725), 3 seeds each; 1e-4 fell to 0.713 on 600 rows "
                        "(bench/RESULTS.md, issue 10). Base-size models (BERT, DistilBERT) are usually tuned lower: "
                        "try 5e-5 to 1e-4 if the loss spikes")
    g.add_argument("--optimizer", choices=("adamw", "adam"), default="adamw")
    g.add_argument("--weight-decay", type=non_negative_float, default=0.01, help="AdamW decoupled weight decay")
    g.add_argument("--scheduler", choices=("linear", "cosine", "one-cycle", "constant"), default="linear",
                   help="learning-rate schedule after warm-up. linear (to 0): cosine did as well and constant worse "
                        "in the issue-10 study (bench/RESULTS.md)")
    g.add_argument("--warmup", type=non_negative_float, default=0.06,
                   help="warm-up length: a fraction of all steps if below 1, else a step count. 6%% (RoBERTa's "
                        "fine-tuning recipe): short runs spend fewer steps far below the peak rate than with 10%%, "
                        "with test accuracy as good (bench/RESULTS.md, issue 10)")
    g.add_argument("--grad-clip", type=non_negative_float, default=1.0, help="max gradient norm (0 disables)")
    g.add_argument("--seed", type=int, default=123)

    g = p.add_argument_group("speed")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (compiled before the clock starts)")
    g.add_argument("--compile-mode", default="default",
                   choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
    g.add_argument("--grad-checkpointing", action="store_true", help="recompute activations in backward: less "
                   "memory, about a third more compute")
    g.add_argument("--num-workers", type=int, help="DataLoader worker processes per rank (default: from CPU count "
                   "and processes per node)")
    g.add_argument("--peak-tflops", type=positive_float,
                   help="peak dense TFLOP/s of one device in the training precision, for MFU where Fabric does not "
                        "know it: CPUs, and GPUs missing from its table (it warns 'FLOPs not found'), e.g. an H200, "
                        "which reports itself as 'NVIDIA H200' (989 for bf16, as an H100 SXM)")

    g = p.add_argument_group("evaluation, checkpoints and output")
    g.add_argument("--val-every", type=positive_int, help="also validate every N optimizer steps")
    g.add_argument("--out-dir", help="run folder (default: a new folder under runs/)")
    g.add_argument("--early-stop", type=positive_int, help="stop when the validation metric has not improved for "
                   "N validations in a row (the best model is still tested and exported)")
    g.add_argument("--save-every", type=positive_int, help="also checkpoint every N optimizer steps")
    g.add_argument("--keep-last", type=positive_int, default=2, help="keep this many newest step checkpoints")
    g.add_argument("--resume", help="auto: continue from the newest checkpoint in --out-dir (fresh start if none); "
                   "or a checkpoint folder")
    g.add_argument("--logger", default="csv", help="comma list of csv, tensorboard, mlflow, wandb (the CSV log is "
                   "always written: the plots read it)")
    g.add_argument("--tracker-project", default="fabric-template", help="MLflow experiment and W&B project name "
                   "(the run is named after the run folder)")
    g.add_argument("--log-every", type=positive_int, default=10, help="log metrics every N optimizer steps")
    g.add_argument("--quiet", action="store_true", help="no progress bar or log lines")
    return p


def parse_flags(parser: argparse.ArgumentParser, argv=None, presets: dict | None = None) -> argparse.Namespace:
    """Parses ``argv``; ``--config FILE`` values become defaults, and ``presets`` maps a flag to the defaults it
    brings when set (``{"demo": {"lr": 2e-3}}``): the file wins over presets, the command line over both."""
    args = parser.parse_args(argv)
    config = load_config(args.config, parser) if args.config else {}
    parser.set_defaults(**config)
    args = parser.parse_args(argv)
    for flag, defaults in (presets or {}).items():
        if getattr(args, flag):
            parser.set_defaults(**{name: value for name, value in defaults.items() if name not in config})
            args = parser.parse_args(argv)
    for name in args.logger.split(","):
        if name not in LOGGER_NAMES:
            raise UserError(f"unknown logger {name!r}: --logger takes a comma list of {', '.join(LOGGER_NAMES)}")
    if args.num_workers is not None and args.num_workers < 0:
        raise UserError("--num-workers must be 0 or more")
    return args


def load_config(path: str, parser: argparse.ArgumentParser) -> dict:
    if not os.path.isfile(path):
        raise UserError(f"config file {path} does not exist")
    with open(path) as f:
        config = yaml.safe_load(f) or {}
    known = {a.dest for a in parser._actions}
    unknown = sorted(set(config) - known)
    if unknown:
        raise UserError(f"config file {path} has unknown keys {unknown}")
    config.pop("config", None)
    return config
