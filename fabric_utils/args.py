"""The training loop's flags and their parsing (the task adds its own); no torch here, so ``--help`` answers at once."""

import argparse
import contextlib
import difflib
import os
from pathlib import Path

from fabric_utils.errors import UserError

# Fabric's names written out, as Lightning's import takes seconds; strategies that rerun this script (not *_spawn)
FSDP2 = "fsdp2"  # PyTorch's fully_shard, through Fabric's ModelParallelStrategy; not in its registry
FSDP1, FSDP1_OFFLOAD = "fsdp", "fsdp_cpu_offload"  # Fabric's names for torch's FSDP1: run as fsdp2, or refused
ACCELERATORS = ("auto", "cpu", "cuda", "mps", "tpu")
STRATEGIES = ("auto", "ddp", "ddp_find_unused_parameters_true", "dp", "deepspeed", "deepspeed_stage_1",
              "deepspeed_stage_1_offload", "deepspeed_stage_2", "deepspeed_stage_2_offload", "deepspeed_stage_3",
              "deepspeed_stage_3_offload", "deepspeed_stage_3_offload_nvme", FSDP1, FSDP1_OFFLOAD, "single_xla",
              "single_tpu", FSDP2)
FP8 = "fp8-mixed"  # torchao's float8 matrix products in bf16-mixed autocast (fp8.py); not Fabric's
PRECISIONS = ("auto", "transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true",
              "bf16-mixed", "32-true", "64-true", "64", "32", "16", "bf16", FP8)
LOGGER_NAMES = ("csv", "tensorboard", "mlflow", "wandb")
# applied after parsing: a launch flag left unset (None) is one `fabric run` may set instead
LAUNCH_DEFAULTS = {"accelerator": "auto", "devices": "auto", "num_nodes": 1, "strategy": "auto", "precision": "auto"}
RUN_MARKER = ".fabric-template-run"  # what a run writes into its folder: a user may keep a config.yaml there too


def number(convert, ok, what: str):
    """An argparse type: the text through ``convert``, refused unless ``ok`` with "must be ``what``"."""
    def parse(text: str):
        with contextlib.suppress(ValueError):
            if ok(value := convert(text)):
                return value
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return parse


positive_int = number(int, lambda value: value > 0, "a positive integer")
non_negative_int = number(int, lambda value: value >= 0, "zero or a positive integer")
positive_float = number(float, lambda value: value > 0, "a positive number")
non_negative_float = number(float, lambda value: value >= 0, "zero or positive")
probability = number(float, lambda value: 0 <= value < 1, "in [0, 1)")


def dropout(text: str):
    """A probability, or "model" (None): keep the model config's."""
    return None if text == "model" else probability(text)


def batch_size(text: str):
    return "auto" if text == "auto" else positive_int(text)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors, no abbreviated flags and a close match for an unknown one."""

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {message}\n")

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(self.unknown_flags(unknown))
        return parsed

    def unknown_flags(self, words: list[str]) -> str:
        flags = [word.split("=", 1)[0] for word in words if word.startswith("--")]
        if not flags:
            return f"unrecognized arguments: {' '.join(words)}"
        known = [option for action in self._actions for option in action.option_strings]
        named = [flag + "".join(f" (did you mean {close}?)" for close in difflib.get_close_matches(flag, known, n=1))
                 for flag in flags]
        return f"unknown flag{'s' * (len(flags) > 1)} {', '.join(named)}; --help lists every flag"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows the launch flags' defaults too (applied after parsing), and no "None" where the help explains it."""

    def _get_help_string(self, action):
        if action.dest in LAUNCH_DEFAULTS:
            return f"{action.help} (default: {LAUNCH_DEFAULTS[action.dest]})"
        return action.help if action.default is None else super()._get_help_string(action)


def launched_by_cli() -> bool:
    return os.environ.get("LT_CLI_USED") == "1"


def build_parser(description: str) -> argparse.ArgumentParser:
    p = Parser(description=description, formatter_class=HelpFormatter)
    p.add_argument("--config", help="YAML file of flag values (as written to config.yaml); flags given here win")

    g = p.add_argument_group("launch (as in `fabric run`; under `fabric run`, pass them there instead)")
    g.add_argument("--accelerator", choices=ACCELERATORS, help="hardware to run on")
    g.add_argument("--devices", help="devices per node: a count (4), a list (0,1), -1 or auto")
    g.add_argument("--num-nodes", type=int, help="number of machines")
    g.add_argument("--strategy", choices=STRATEGIES, help="how to spread the work: ddp, fsdp2, deepspeed_stage_2, ...")
    g.add_argument("--precision", choices=PRECISIONS, help="numeric precision; auto: bf16-mixed where it runs faster "
                   "than fp32, 16-mixed on older GPUs (32-true under fsdp2: no loss scaler), else 32-true; "
                   f"{FP8}: float8 on H100-class GPUs (torchao)")

    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=positive_int, default=3)
    g.add_argument("--max-steps", type=positive_int, help="stop after this many optimizer steps (overrides --epochs)")
    g.add_argument("--batch-size", type=batch_size, default=16,
                   help="rows per device per micro-batch, or auto: the largest that fits")
    g.add_argument("--eval-batch-size", type=positive_int, help="rows per device when evaluating (default 2x batch)")
    g.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--lr", type=positive_float, help="peak learning rate (default: the task's for its model and steps)")
    g.add_argument("--optimizer", choices=("adamw", "adam"), default="adamw")
    g.add_argument("--weight-decay", type=non_negative_float, default=0.01, help="AdamW decoupled weight decay")
    g.add_argument("--scheduler", choices=("linear", "cosine", "one-cycle", "constant"), default="linear",
                   help="learning-rate schedule after warm-up (linear and cosine end at --min-lr-rate)")
    g.add_argument("--warmup", type=non_negative_float, default=0.06,
                   help="warm-up length: a fraction of all steps if below 1, else a step count")
    g.add_argument("--min-lr-rate", type=probability, default=0.3, help="where linear and cosine decay end, a "
                   "fraction of the peak (a short fine-tune still learns at its end; try 0 for 100+ steps)")
    g.add_argument("--grad-clip", type=non_negative_float, default=1.0, help="max gradient norm (0 disables)")
    g.add_argument("--seed", type=int, default=123)

    g = p.add_argument_group("speed")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (compiled before the clock starts)")
    g.add_argument("--compile-mode", default="default",
                   choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
    g.add_argument("--grad-checkpointing", action="store_true", help="recompute the model's blocks' activations in "
                   "backward: less memory, about a third more compute")
    g.add_argument("--group-by-length", action=argparse.BooleanOptionalAction, default=True,
                   help="batch training rows of similar length, so padding stays small")
    g.add_argument("--num-workers", type=non_negative_int, help="DataLoader workers per rank (default: from the CPUs)")
    g.add_argument("--num-threads", type=positive_int, help="intra-op CPU threads per process (default: "
                   "OMP_NUM_THREADS where you set it, else this process's idle CPUs shared by the node's processes)")
    g.add_argument("--peak-tflops", type=positive_float, help="a device's peak dense TFLOP/s in its precision, for "
                   "MFU where Fabric lacks it (CPUs, GPUs it warns 'FLOPs not found' for)")

    g = p.add_argument_group("evaluation, checkpoints and output")
    g.add_argument("--val-every", type=positive_int, help="also validate every N optimizer steps")
    g.add_argument("--out-dir", help="run folder (default: a new folder under runs/)")
    g.add_argument("--best-metric", help="the validation metric that picks checkpoints/best: loss or one of the task's "
                   "(default: the task's), NAME:max or NAME:min where its direction is unknown")
    g.add_argument("--early-stop", type=positive_int, help="stop after N validations in a row without improving")
    g.add_argument("--save-every", type=positive_int, help="also checkpoint every N optimizer steps")
    g.add_argument("--keep-last", type=positive_int, default=2, help="keep this many newest step checkpoints")
    g.add_argument("--no-async-save", dest="async_save", action="store_false",
                   help="write checkpoints with training stopped (default: in the background, one at a time)")
    g.add_argument("--keep-best-checkpoint", action="store_true",
                   help="keep checkpoints/best after the run (model/ holds its weights)")
    g.add_argument("--resume", help="auto: continue from the newest checkpoint in --out-dir (fresh start if none), "
                   "with the flags of its config.yaml unless --config is given; or a checkpoint folder")
    g.add_argument("--logger", default="csv", help="comma list of csv (always: the plots read it), tensorboard, "
                   "mlflow, wandb")
    g.add_argument("--tracker-project", default="fabric-template", help="MLflow experiment and W&B project name")
    g.add_argument("--log-every", type=positive_int, default=10, help="log metrics every N optimizer steps")
    g.add_argument("--fast-dev-run", type=positive_int, nargs="?", const=2, metavar="N", help="check the whole run "
                   "in seconds: N batches of each split (2 if no N) and the export, in a temporary folder")
    g.add_argument("--quiet", action="store_true", help="no header, progress or validation lines")
    g.add_argument("--verbose", action="store_true", help="also print the environment and the libraries' logs and bars")
    return p


def parse_flags(parser: argparse.ArgumentParser, argv=None, presets: dict | None = None) -> argparse.Namespace:
    """Parses ``argv`` over defaults from ``--config FILE`` (or the resumed run's ``config.yaml``), themselves over
    ``presets`` (``{"demo": {"epochs": 1}}``: defaults a flag brings when set); ``--fast-dev-run`` then overrides."""
    args = parser.parse_args(argv)
    run_folder = Path(args.out_dir) if args.resume == "auto" and args.out_dir else None
    resumed = run_folder / "config.yaml" if run_folder and (run_folder / RUN_MARKER).is_file() else None
    config_file = args.config or (str(resumed) if resumed and resumed.is_file() else None)
    config = {}
    if config_file:
        from fabric_utils.config_file import load_config
        config = load_config(config_file, parser)
    parser.set_defaults(**config)
    args = parser.parse_args(argv)
    for flag, defaults in (presets or {}).items():
        if getattr(args, flag):
            parser.set_defaults(**{name: value for name, value in defaults.items() if name not in config})
            args = parser.parse_args(argv)
    for name in args.logger.split(","):
        if name not in LOGGER_NAMES:
            raise UserError(f"unknown logger {name!r}: --logger takes a comma list of {', '.join(LOGGER_NAMES)}")
    if launched_by_cli():  # checked before torch loads
        from fabric_utils.fabric_run import fabric_run_settings
        fabric_run_settings({name: getattr(args, name) for name in LAUNCH_DEFAULTS})
    if args.fast_dev_run:
        for flag in ("out_dir", "resume"):
            if getattr(args, flag):
                raise UserError(f"--fast-dev-run runs in a temporary folder it removes: drop "
                                f"--{flag.replace('_', '-')}")
        vars(args).update(max_steps=args.fast_dev_run, logger="csv", save_every=None, val_every=None)
    return args


class Config(argparse.Namespace):
    """Every value a run uses, read-only: the flags, with ``decided`` for those the run settled itself."""

    def __init__(self, flags: argparse.Namespace, **decided):
        self.__dict__.update(vars(flags), **decided)  # past __setattr__, which refuses

    def __setattr__(self, name: str, value=None) -> None:
        raise AttributeError(f"the run's config is read-only: decide {name} before making it")

    __delattr__ = __setattr__
