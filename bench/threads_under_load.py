"""The demo's training rows/s on a shared machine: under a steady background load (busy processes, one per core by
default), the template's own thread choice against OMP_NUM_THREADS=1, and two processes started by `fabric run`
against `python train.py --devices 2`, side by side in one call, each pair run alternately --repeats times (median).

    .venv/bin/python bench/threads_under_load.py [--busy 2] [--repeats 3] [--train-size 1600]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.run_bench import machine  # noqa: E402

BUSY = "while True: pass"


def configurations(train_size: int) -> dict[str, tuple[list[str], dict]]:
    """Name -> (command, extra environment): the demo on the CPU, one epoch of ``train_size`` rows."""
    flags = ["train.py", "--demo", "--accelerator", "cpu", "--precision", "32-true", "--train-size", str(train_size),
             "--epochs", "1", "--quiet", "--num-workers", "0"]
    fabric = str(Path(sys.executable).with_name("fabric"))
    return {
        "1 process, the template's threads": ([sys.executable, *flags], {}),
        "1 process, OMP_NUM_THREADS=1": ([sys.executable, *flags], {"OMP_NUM_THREADS": "1"}),
        "2 processes, python train.py --devices 2": ([sys.executable, *flags, "--devices", "2", "--strategy", "ddp"], {}),
        "2 processes, fabric run --devices 2": (
            [fabric, "run", "--accelerator", "cpu", "--devices", "2", "--strategy", "ddp", *flags], {}),
    }


def rows_per_s(command: list[str], env: dict) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        subprocess.run([*command, "--out-dir", str(out)], cwd=ROOT, env={**os.environ, **env}, check=True,
                       stdout=subprocess.DEVNULL)
        return json.loads((out / "results.json").read_text())["train_samples_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--busy", type=int, default=os.cpu_count(), help="busy background processes (default: one a CPU)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--train-size", type=int, default=1600)
    args = p.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.busy)]
    try:
        found = {name: [] for name in configurations(args.train_size)}
        for _ in range(args.repeats):
            for name, (command, env) in configurations(args.train_size).items():
                found[name].append(rows_per_s(command, env))
    finally:
        for process in busy:
            process.kill()
    median = {name: statistics.median(values) for name, values in found.items()}
    names = list(median)
    print(f"machine: {machine()}; {args.busy} busy background processes; median of {args.repeats} runs each\n")
    print("| configuration | train rows/s (median) | runs | ratio |\n|---|---|---|---|")
    for name, against in ((names[0], names[1]), (names[1], names[1]), (names[3], names[2]), (names[2], names[2])):
        values = ", ".join(f"{value:.0f}" for value in found[name])
        print(f"| {name} | {median[name]:.0f} | {values} | {median[name] / median[against]:.2f}x of {against} |")


if __name__ == "__main__":
    main()
