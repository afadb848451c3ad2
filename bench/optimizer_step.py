"""AdamW's step alone, fused against multi-tensor (foreach), on the benchmark model's real parameters and the
template's own parameter groups: what the fused default buys per optimizer step on this machine.

    python bench/optimizer_step.py --repeats 10
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.run_bench import default_model  # noqa: E402
from fabric_utils.optim import build_optimizer  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: all-MiniLM-L6-v2 from requirements-bench.txt")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(args.model or default_model(), num_labels=2,
                                                               trust_remote_code=False)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    cpu = torch.device("cpu")
    optimizers = {"fused": build_optimizer(model, "adamw", lr=1e-4, weight_decay=0.01, device=cpu),
                  "foreach": build_optimizer(model, "adamw", lr=1e-4, weight_decay=0.01, device=cpu,
                                             loss_scaling=True)}  # loss scaling is what keeps foreach
    times = {name: [] for name in optimizers}
    for optimizer in optimizers.values():
        optimizer.step()  # allocates the state
    for _ in range(args.repeats):  # interleaved, so a change in the machine's load touches both alike
        for name, optimizer in optimizers.items():
            start = time.perf_counter()
            optimizer.step()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.1f}M parameters, {torch.get_num_threads()} threads, median of {args.repeats} steps")
    for name, seconds in medians.items():
        print(f"{name:8s} {seconds * 1e3:8.1f} ms")
    print(f"foreach / fused: {medians['foreach'] / medians['fused']:.1f}x")


if __name__ == "__main__":
    main()
