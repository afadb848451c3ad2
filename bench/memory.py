"""Memory per rank (issue 16): the same short job under ddp, fsdp2 and deepspeed_stage_3 on 2 CPU processes, with a
BERT-shaped model of random weights saved once in fp32 and once in bf16, with and without LoRA. Prints each rank's
peak resident memory (results.json's peak_memory_mb_per_rank) and its ratio to ddp's same rank.

    python bench/memory.py                                      # BERT-large shape (335M parameters), 12 runs
    python bench/memory.py --layers 12 --hidden 768 --saved bf16 --strategies ddp,fsdp2

ZeRO-3 runs through the test-only DeepSpeed CPU shim (tests/shims). Each run is its own ``train.py`` process pair,
one after another: a few optimizer steps on the offline demo's data, then the usual best-checkpoint test and export
(rank 0 gathers the full model for the export under every strategy, so its peak holds one full copy more than rank
1's).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from data.demo import prepare_demo  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# a few steps of 4 rows of at most 32 tokens, on each of 2 processes: memory is weights, gradients, optimizer state
JOB = ["--accelerator", "cpu", "--devices", "2", "--precision", "bf16-mixed", "--train-size", "24", "--val-size", "8",
       "--test-size", "8", "--batch-size", "4", "--max-length", "32", "--max-steps", "3", "--num-workers", "0",
       "--quiet"]


def save_models(folder: Path, hidden: int, layers: int, saved: list[str]) -> dict[str, Path]:
    """One random BERT-shaped classifier, saved with ``save_pretrained`` in each dtype of ``saved``, beside the
    demo's tokenizer (the model's vocabulary is BERT's, larger than the tokenizer's)."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    _, demo_model = prepare_demo(Path.home() / ".cache" / "fabric-template" / "demo")
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    config = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                        intermediate_size=4 * hidden, num_labels=2)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    folders = {}
    for name in saved:
        folders[name] = folder / name
        model.to(DTYPES[name]).save_pretrained(folders[name])  # config.dtype records the dtype, as a hub model's
        tokenizer.save_pretrained(folders[name])
    return folders


def run_job(model: Path, strategy: str, lora_r: int, out_dir: Path) -> dict:
    """One 2-process run of train.py; its results.json."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    if strategy.startswith("deepspeed"):  # DeepSpeed needs CUDA; the tests' shim runs it on CPU processes
        env.update(FABRIC_TEMPLATE_DEEPSPEED_CPU="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "shims"), str(ROOT)]))
    data, _ = prepare_demo(Path.home() / ".cache" / "fabric-template" / "demo")
    command = [sys.executable, "train.py", *JOB, "--dataset", str(data), "--model", str(model),
               "--strategy", strategy, "--lora-r", str(lora_r), "--out-dir", str(out_dir)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads((out_dir / "results.json").read_text())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024, help="BERT-large: 1024 wide, 24 layers (335M parameters)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--saved", default="fp32,bf16", help="the dtypes the model is saved in")
    p.add_argument("--strategies", default="ddp,fsdp2,deepspeed_stage_3", help="ddp first: the ratios are to it")
    p.add_argument("--lora-r", default="0,8", help="LoRA ranks to run (0: full fine-tuning)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()
    saved, strategies = args.saved.split(","), args.strategies.split(",")

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = save_models(Path(tmp), args.hidden, args.layers, saved)
        for dtype in saved:
            for lora_r in map(int, args.lora_r.split(",")):
                ddp = None
                for strategy in strategies:
                    results = run_job(models[dtype], strategy, lora_r, Path(tmp) / f"{dtype}-{lora_r}-{strategy}")
                    peaks = results["peak_memory_mb_per_rank"]
                    ddp = ddp or (peaks if strategy == "ddp" else None)
                    row = {"saved": dtype, "lora_r": lora_r, "strategy": strategy, "peaks_mb": peaks,
                           "ratios": [peak / base for peak, base in zip(peaks, ddp)] if ddp else None,
                           "fp32_mb": results["total_params"] * 4 / 2**20, "params": results["total_params"],
                           "trainable": results["trainable_params"], "test_loss": results["test_loss"]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print(f"\nmodel: {rows[0]['params'] / 1e6:.0f}M parameters, {rows[0]['fp32_mb']:,.0f} MB in fp32\n")
    print("| saved | LoRA | strategy | rank 0 peak MB (x ddp) | rank 1 peak MB (x ddp) |")
    print("|---|---|---|---|---|")
    for row in rows:
        cells = [f"{peak:,.0f}" + (f" ({ratio:.2f}x)" if row["ratios"] else "")
                 for peak, ratio in zip(row["peaks_mb"], row["ratios"] or row["peaks_mb"])]
        print(f"| {row['saved']} | {row['lora_r'] or 'no'} | {row['strategy']} | {' | '.join(cells)} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
