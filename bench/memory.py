"""Memory per rank: the same short job under ddp, fsdp2 and deepspeed_stage_3 on 2 CPU processes, with a
BERT-shaped model of random weights saved once in fp32 and once in bf16, with and without LoRA. Prints each rank's
peak resident memory (results.json's peak_memory_mb_per_rank) and its ratio to ddp's same rank.

    python bench/memory.py                                      # BERT-large shape (335M parameters), 12 runs
    python bench/memory.py --layers 12 --hidden 768 --saved bf16 --strategies ddp,fsdp2

ZeRO-3 runs through the test-only DeepSpeed CPU shim (tests/shims). Each run is its own ``train.py`` process pair,
one after another: a few optimizer steps on the offline demo's data, then the usual best-checkpoint test and export
(rank 0 gathers the full model for the export under every strategy, so its peak holds one full copy more than rank
1's).

``--stage build-load`` measures the start alone: each rank's anonymous memory (RssAnon, so not the page cache of the
memory-mapped pretrained file) from the model's build until it is set up with its pretrained values loaded
(bench/build_load_probe.py), under fsdp (FSDP1, through the tests' CPU shim too), fsdp2 and ZeRO-3, against the
target fp32 model bytes / ranks + the largest shard unit + 150 MB. ``--before DIR`` also measures another checkout (a
``git worktree`` of an earlier commit) for comparison:

    python bench/memory.py --stage build-load --layers 12 --hidden 768 --before /tmp/before

It measures the text task as shipped: its models are Hugging Face text classifiers beside the offline demo's
tokenizer, and its rows the demo's (data/demo.py).
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
    tokenizer = AutoTokenizer.from_pretrained(demo_model, trust_remote_code=False)
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
    run_train(ROOT, "train.py", model, strategy, lora_r, out_dir)
    return json.loads((out_dir / "results.json").read_text())


def run_train(checkout: Path, script: str, model: Path, strategy: str, lora_r: int, out_dir: Path,
              **env) -> None:
    """``script`` (train.py or a probe of it) with JOB's flags on 2 processes, in ``checkout``; DeepSpeed needs
    CUDA, and the tests' shim runs it on CPU processes."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "FABRIC_TEMPLATE_DEEPSPEED_CPU": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "shims"), str(checkout)]), **env}
    data, _ = prepare_demo(Path.home() / ".cache" / "fabric-template" / "demo")
    command = [sys.executable, script, *JOB, "--dataset", str(data), "--model", str(model),
               "--strategy", strategy, "--lora-r", str(lora_r), "--out-dir", str(out_dir)]
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}\n{done.stderr[-3000:]}")


def build_and_load(models: dict[str, Path], strategies: list[str], checkouts: dict[str, Path], tmp: Path) -> list:
    """Each rank's anonymous memory from the model's build until it is set up and loaded, per saved dtype,
    strategy and checkout; with the target: the fp32 model over 2 ranks, its largest shard unit, 150 MB."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(next(iter(models.values())), trust_remote_code=False)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    layers = model.bert.encoder.layer
    whole, layer = (sum(p.numel() for p in module.parameters()) for module in (model, layers[0]))
    largest_unit = max(layer, whole - len(layers) * layer)  # a block, or the root unit: embeddings and head
    target_mb = (whole * 4 / 2 + largest_unit * 4) / 2**20 + 150
    rows = []
    for dtype, folder in models.items():
        for strategy in strategies:
            for code, checkout in checkouts.items():
                found = tmp / f"probe-{dtype}-{strategy}-{code}"
                run_train(checkout, str(ROOT / "bench" / "build_load_probe.py"), folder, strategy, 0,
                          tmp / f"run-{dtype}-{strategy}-{code}", PROBE_OUT=str(found))
                ranks = [json.loads((found / f"rank-{rank}.json").read_text()) for rank in range(2)]
                row = {"saved": dtype, "strategy": strategy, "code": code, "ranks": ranks,
                       "target_mb": target_mb, "params": whole, "largest_unit": largest_unit}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\nmodel: {whole / 1e6:.0f}M parameters, {whole * 4 / 2**20:,.0f} MB in fp32, largest unit "
          f"{largest_unit * 4 / 2**20:,.0f} MB; target per rank {target_mb:,.0f} MB above the start\n")
    print("RssAnon MB above the start of the build (each rank's own memory): peak until set-up / peak until set up and "
          "loaded / held then\n")
    print("| saved | strategy | code | rank 0 | rank 1 | peak within target |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        cells = [" / ".join(f"+{r[key] - r['start_mb']:,.0f}" for key in ("built_peak_mb", "peak_mb", "end_mb"))
                 for r in row["ranks"]]
        within = all(r["peak_mb"] - r["start_mb"] <= row["target_mb"] for r in row["ranks"])
        print(f"| {row['saved']} | {row['strategy']} | {row['code']} | {' | '.join(cells)} | "
              f"{'yes' if within else 'no'} |")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024, help="BERT-large: 1024 wide, 24 layers (335M parameters)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--saved", default="fp32,bf16", help="the dtypes the model is saved in")
    p.add_argument("--stage", choices=("train", "build-load"), default="train",
                   help="train: each rank's peak over a short run; build-load: from the build to the loaded model")
    p.add_argument("--strategies", help="default ddp,fsdp2,deepspeed_stage_3 (train: ddp first, the ratios are to "
                   "it), fsdp,fsdp2,deepspeed_stage_3 (build-load)")
    p.add_argument("--before", type=Path, help="build-load: also measure this checkout (an earlier commit's)")
    p.add_argument("--lora-r", default="0,8", help="LoRA ranks to run (0: full fine-tuning)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()
    saved = args.saved.split(",")
    strategies = (args.strategies or ("ddp,fsdp2,deepspeed_stage_3" if args.stage == "train"
                                      else "fsdp,fsdp2,deepspeed_stage_3")).split(",")

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = save_models(Path(tmp), args.hidden, args.layers, saved)
        if args.stage == "build-load":
            checkouts = {"before": args.before.resolve(), "after": ROOT} if args.before else {"this": ROOT}
            rows = build_and_load(models, strategies, checkouts, Path(tmp))
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))
            return
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
