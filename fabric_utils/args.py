"""The training loop's flags and their parsing (the task adds its own: ``fabric_utils.task_spec``). Nothing here imports
torch or Lightning, so ``--help`` and a bad value answer at once."""

import argparse
import contextlib
import copy
import difflib
import os
from pathlib import Path

import psutil
import yaml

from fabric_utils.errors import UserError

# Fabric's names written out, as importing Lightning takes seconds (tests/infra/test_launcher.py checks them): the
# strategies fabric.launch() starts by running this script again (not ddp_spawn, ddp_fork, ddp_notebook, xla, xla_fsdp)
FSDP2 = "fsdp2"  # PyTorch's current FSDP (fully_shard), through Fabric's ModelParallelStrategy; not in its registry
ACCELERATORS = ("auto", "cpu", "cuda", "mps", "tpu")
STRATEGIES = ("auto", "ddp", "ddp_find_unused_parameters_true", "dp", "deepspeed", "deepspeed_stage_1",
              "deepspeed_stage_1_offload", "deepspeed_stage_2", "deepspeed_stage_2_offload", "deepspeed_stage_3",
              "deepspeed_stage_3_offload", "deepspeed_stage_3_offload_nvme", "fsdp", "fsdp_cpu_offload", "single_xla",
              "single_tpu", FSDP2)
FP8 = "fp8-mixed"  # torchao's float8 matrix products in bf16-mixed autocast (fabric_utils/speed.py); not Fabric's
PRECISIONS = ("auto", "transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true",
              "bf16-mixed", "32-true", "64-true", "64", "32", "16", "bf16", FP8)
LOGGER_NAMES = ("csv", "tensorboard", "mlflow", "wandb")
# the launch flags' defaults, applied after parsing: a flag left unset (None) is one `fabric run` may set instead
LAUNCH_DEFAULTS = {"accelerator": "auto", "devices": "auto", "num_nodes": 1, "strategy": "auto", "precision": "auto"}


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
probability = number(float, lambda value: 0 <= value < 1, "in [0, 1)")  # a rate: a dropout, the learning-rate floor


def dropout(text: str):
    """A probability, or "model" (None): keep what the model's config says."""
    return None if text == "model" else probability(text)


def batch_size(text: str):
    return "auto" if text == "auto" else positive_int(text)


class Parser(argparse.ArgumentParser):
    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)  # a misspelt flag is refused, not taken for a longer one

    def error(self, message: str):
        """One line, as every other bad input: the usage block is for --help."""
        self.exit(2, f"error: {message}\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but an unknown flag is named with the closest known one."""
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
    """Shows defaults, the launch flags' too (applied after parsing), but not "None" where the help explains it."""

    def _get_help_string(self, action):
        if action.dest in LAUNCH_DEFAULTS:
            return f"{action.help} (default: {LAUNCH_DEFAULTS[action.dest]})"
        return action.help if action.default is None else super()._get_help_string(action)


def launched_by_cli() -> bool:
    return os.environ.get("LT_CLI_USED") == "1"


def fabric_run_settings(flags: dict) -> dict:
    """The settings ``fabric run`` passes on as ``LT_*`` variables; one given to the script too (``flags``) with
    another value, or to ``fabric run`` twice (it takes the last, even after train.py), is a ``UserError``."""
    if not launched_by_cli():
        return {}
    settings = {name: os.environ[var] for name in LAUNCH_DEFAULTS if (var := f"LT_{name.upper()}") in os.environ}
    given = _fabric_run_options()
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if len(set(given.get(name, []))) > 1:
            raise UserError(f"{flag} is given to `fabric run` twice ({' and '.join(given[name])}), and it took the "
                            f"last ({value}) even if it came after train.py; give {flag} once")
        if flags.get(name) is not None and str(flags[name]) != value:
            raise UserError(f"{flag} is set twice: `fabric run` has {value} (its default if not given there) and "
                            f"train.py has {flags[name]}; remove {flag} from the train.py arguments")
    return settings


def _fabric_run_options() -> dict[str, list[str]]:
    """Each launch setting's values on ``fabric run``'s command line: this process's parent's (torchrun's agent)."""
    try:
        argv = psutil.Process(os.getppid()).cmdline()
    except psutil.Error:  # gone, or not ours to read
        return {}
    values = {}
    for i, word in enumerate(argv):
        option, equals, value = word.partition("=")
        name = option.removeprefix("--").replace("-", "_")
        if option.startswith("--") and name in LAUNCH_DEFAULTS and (equals or i + 1 < len(argv)):
            values.setdefault(name, []).append(value if equals else argv[i + 1])
    return values


def build_parser(description: str) -> argparse.ArgumentParser:
    """The training loop's flags, whatever the task, to which the task adds its own (data, model)."""
    p = Parser(description=description, formatter_class=HelpFormatter)
    p.add_argument("--config", help="YAML file of flag values (as written to config.yaml); flags given here win")

    g = p.add_argument_group("launch (as in `fabric run`; under `fabric run`, pass them there instead)")
    g.add_argument("--accelerator", choices=ACCELERATORS, help="hardware to run on")
    g.add_argument("--devices", help="devices per node: a count (4), a list (0,1), -1 or auto")
    g.add_argument("--num-nodes", type=int, help="number of machines")
    g.add_argument("--strategy", choices=STRATEGIES, help="how to spread the work: ddp, fsdp2, deepspeed_stage_2, ...")
    g.add_argument("--precision", choices=PRECISIONS, help="numeric precision; auto: bf16-mixed where the hardware "
                   "runs it faster than fp32, 16-mixed on older GPUs (32-true under fsdp2: no loss scaler), "
                   f"else 32-true; {FP8}: float8 matrix products on H100-class GPUs (torchao)")

    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=positive_int, default=3)
    g.add_argument("--max-steps", type=positive_int, help="stop after this many optimizer steps (overrides --epochs)")
    g.add_argument("--batch-size", type=batch_size, default=16,
                   help="rows per device per micro-batch, or auto: the largest that fits")
    g.add_argument("--eval-batch-size", type=positive_int, help="rows per device when evaluating (default 2x batch)")
    g.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step; DDP, FSDP "
                   "and ZeRO-1 reduce gradients only on the last, ZeRO-2/3 on every one (they keep only their shard)")
    g.add_argument("--lr", type=positive_float, help="peak learning rate (default: the task's choice for the model it "
                   "loads and the run's optimizer steps, which its flags' help describes)")
    g.add_argument("--optimizer", choices=("adamw", "adam"), default="adamw")
    g.add_argument("--weight-decay", type=non_negative_float, default=0.01, help="AdamW decoupled weight decay")
    g.add_argument("--scheduler", choices=("linear", "cosine", "one-cycle", "constant"), default="linear",
                   help="learning-rate schedule after warm-up (linear and cosine end at --min-lr-rate)")
    g.add_argument("--warmup", type=non_negative_float, default=0.06, help="warm-up length, a fraction of all steps "
                   "if below 1 or else a step count (6%%, RoBERTa's recipe, keeps short runs near the peak rate)")
    g.add_argument("--min-lr-rate", type=probability, default=0.3, help="where linear and cosine decay end, as a "
                   "fraction of the peak rate (a short fine-tune still learns fast at its end; try 0 for 100+ steps)")
    g.add_argument("--grad-clip", type=non_negative_float, default=1.0, help="max gradient norm (0 disables)")
    g.add_argument("--seed", type=int, default=123)

    g = p.add_argument_group("speed")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (compiled before the clock starts)")
    g.add_argument("--compile-mode", default="default",
                   choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
    g.add_argument("--grad-checkpointing", action="store_true", help="recompute the model's blocks' activations in "
                   "backward: less memory, about a third more compute")
    g.add_argument("--group-by-length", action=argparse.BooleanOptionalAction, default=True, help="batch training "
                   "rows of similar size (where the task gives sizes, e.g. tokens) so per-batch padding stays small")
    g.add_argument("--num-workers", type=non_negative_int, help="DataLoader worker processes per rank (default: from "
                   "CPU count and processes per node)")
    g.add_argument("--num-threads", type=positive_int, help="intra-op CPU threads per process (default: "
                   "OMP_NUM_THREADS where you set it, else the CPUs this process may use that are idle at its start, "
                   "divided among the node's processes; under `fabric run` and torchrun, which set OMP_NUM_THREADS "
                   "themselves, the latter)")
    g.add_argument("--peak-tflops", type=positive_float, help="peak dense TFLOP/s of a device in its precision, for "
                   "MFU where Fabric lacks it (CPUs; GPUs it warns 'FLOPs not found' for: an H200 does 989 in bf16)")

    g = p.add_argument_group("evaluation, checkpoints and output")
    g.add_argument("--val-every", type=positive_int, help="also validate every N optimizer steps")
    g.add_argument("--out-dir", help="run folder (default: a new folder under runs/)")
    g.add_argument("--best-metric", help="the validation metric that picks checkpoints/best (and --early-stop): loss "
                   "or one of the task's metrics, NAME:max or NAME:min where its direction is not known (default: the "
                   "task's, e.g. acc); ties go to the lower validation loss")
    g.add_argument("--early-stop", type=positive_int, help="stop when the validation metric has not improved for "
                   "N validations in a row (the best model is still tested and exported)")
    g.add_argument("--save-every", type=positive_int, help="also checkpoint every N optimizer steps")
    g.add_argument("--keep-last", type=positive_int, default=2, help="keep this many newest step checkpoints")
    g.add_argument("--keep-best-checkpoint", action="store_true", help="keep checkpoints/best once the run has "
                   "finished (removed by default: model/ holds the same weights, in the task's export format)")
    g.add_argument("--resume", help="auto: continue from the newest checkpoint in --out-dir (fresh start if none), "
                   "with the flags of its config.yaml unless --config is given; or a checkpoint folder")
    g.add_argument("--logger", default="csv", help="comma list of csv, tensorboard, mlflow, wandb (the CSV log is "
                   "always written: the plots read it)")
    g.add_argument("--tracker-project", default="fabric-template", help="MLflow experiment and W&B project name "
                   "(the run is named after the run folder)")
    g.add_argument("--log-every", type=positive_int, default=10, help="log metrics every N optimizer steps")
    g.add_argument("--fast-dev-run", type=positive_int, nargs="?", const=2, metavar="N", help="a check of the whole "
                   "run in seconds (as Lightning's fast_dev_run): N training steps (2 if no N), N validation and test "
                   "batches, the export, in a temporary folder removed at the end; CSV logging only")
    g.add_argument("--quiet", action="store_true", help="no header, progress or validation lines (notices, the "
                   "result and errors still print)")
    g.add_argument("--verbose", action="store_true", help="also print the environment report and what the libraries "
                   "underneath log (Lightning, transformers, DeepSpeed), and draw their progress bars in a log too")
    return p


def parse_flags(parser: argparse.ArgumentParser, argv=None, presets: dict | None = None) -> argparse.Namespace:
    """Parses ``argv``; ``--config FILE`` values (resuming a run folder: its ``config.yaml``'s) become defaults, and
    ``presets`` maps a flag to the defaults it brings when set (``{"demo": {"epochs": 1}}``): the file wins over
    presets, the command line over both; ``--fast-dev-run`` then sets what it overrides."""
    args = parser.parse_args(argv)
    config_file = args.config or run_config(args.out_dir, args.resume)
    config = load_config(config_file, parser) if config_file else {}
    parser.set_defaults(**config)
    args = parser.parse_args(argv)
    for flag, defaults in (presets or {}).items():
        if getattr(args, flag):
            parser.set_defaults(**{name: value for name, value in defaults.items() if name not in config})
            args = parser.parse_args(argv)
    for name in args.logger.split(","):
        if name not in LOGGER_NAMES:
            raise UserError(f"unknown logger {name!r}: --logger takes a comma list of {', '.join(LOGGER_NAMES)}")
    fabric_run_settings({name: getattr(args, name) for name in LAUNCH_DEFAULTS})  # checked before torch loads
    if args.fast_dev_run:  # N optimizer steps, CSV logs only (trackers write elsewhere), in a folder it removes
        for flag in ("out_dir", "resume"):
            if getattr(args, flag):
                raise UserError(f"--fast-dev-run runs in a temporary folder it removes: drop "
                                f"--{flag.replace('_', '-')}")
        vars(args).update(max_steps=args.fast_dev_run, logger="csv", save_every=None, val_every=None)
    return args


def run_config(out_dir: str | None, resume: str | None) -> str | None:
    """The flags of the run that ``--resume auto`` continues (its ``config.yaml``), so that ``--out-dir`` is all a
    resume needs; a flag given now that changes the run is refused when its checkpoint is read."""
    if resume == "auto" and out_dir and (path := Path(out_dir) / "config.yaml").is_file():
        return str(path)
    return None


class Config(argparse.Namespace):
    """Every value a run uses, read-only: the flags as parsed, with ``decided`` in place of those the run settled
    itself (what ``auto`` detected, the batch size that fits); ``vars(config)`` is what config.yaml holds."""

    def __init__(self, flags: argparse.Namespace, **decided):
        for name, value in {**vars(flags), **decided}.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"the run's config is read-only: decide {name} before making it")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"the run's config is read-only: decide {name} before making it")


def load_config(path: str, parser: argparse.ArgumentParser) -> dict:
    """The flag values in YAML file ``path``, checked and converted by ``parser`` as the same flags given to it."""
    if not os.path.isfile(path):
        raise UserError(f"config file {path} does not exist")
    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as err:
        where = f" line {err.problem_mark.line + 1}" if getattr(err, "problem_mark", None) else ""
        raise UserError(f"config file {path}{where}: not valid YAML ({getattr(err, 'problem', None) or err})") from err
    if not isinstance(config, dict):
        raise UserError(f"config file {path} must map flag names to values (as config.yaml does)")
    actions = {a.dest: a for a in parser._actions}
    if unknown := sorted(set(config) - set(actions)):
        raise UserError(f"config file {path} has unknown keys {unknown}")
    config.pop("config", None)
    flags = []  # the values as the command line gives them, for argparse to check and convert (None: left unset)
    for name, value in config.items():
        options, nargs = actions[name].option_strings, actions[name].nargs
        if nargs == 0 and isinstance(value, bool):  # a switch: on, or off (--no-X where it has one)
            flags += options[:1] if value else options[1:]
        elif isinstance(value, list) and nargs in ("+", "*"):
            flags += [options[0], *map(str, value)]
        elif value is not None:
            flags.append(f"{options[0]}={value}")
    checker = copy.copy(parser)
    checker.exit_on_error = False  # a bad value raised, to be said with the file's name
    try:
        parsed = checker.parse_args(flags)
    except argparse.ArgumentError as err:
        raise UserError(f"config file {path}: {err}") from err
    return {name: None if value is None else getattr(parsed, name) for name, value in config.items()}
