"""Every model family the tests build (tests/families.py), under every strategy: one process with and without LoRA,
and LoRA on 2 CPU processes under fsdp2 (with --grad-checkpointing) and deepspeed_stage_3 (the tests' CPU shim). Each
sharded run must export the same weights as one process with the same rows per step; every export must load with
plain transformers (no missing or unexpected keys), give one-row logits equal to right-padded batched ones, and be read
by predict.py. Prints the matrix, a cell per family and run (ok, or the first line that went wrong), and writes it.

    python bench/families.py                                    # all families, ~25 min on 2 CPU cores
    python bench/families.py --families llama,t5 --report docs/studies/families_matrix
"""

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from data.demo import prepare_demo  # noqa: E402
from families import FAMILIES, write_family_model  # noqa: E402

TEXTS = ["a good film", "boring and messy but the cast was superb and the music moving", "dull", "the plot was fun"]
SMALL = ["--accelerator", "cpu", "--precision", "32-true", "--train-size", "48", "--val-size", "16", "--test-size",
         "16", "--max-length", "64", "--max-steps", "2", "--quiet", "--num-workers", "0"]
EXACT = ["--lr", "1e-2", "--attention-dropout", "0", "--hidden-dropout", "0", "--no-group-by-length"]
# run -> (flags, processes); every LoRA run takes 8 rows per optimizer step, so the sharded ones match "lora"
RUNS = {"full": (["--batch-size", "8"], 1),
        "lora": (["--batch-size", "8", "--lora-r", "4"], 1),
        "fsdp2+lora": (["--batch-size", "4", "--lora-r", "4", "--strategy", "fsdp2", "--grad-checkpointing"], 2),
        "zero3+lora": (["--batch-size", "4", "--lora-r", "4", "--strategy", "deepspeed_stage_3"], 2)}


def train(data: Path, model: Path, out: Path, flags: list, devices: int) -> str | None:
    """The run's failure, its last error line, or None."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "FABRIC_TEMPLATE_DEEPSPEED_CPU": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "shims"),
                                                                               str(ROOT)])}
    command = [sys.executable, "train.py", "--dataset", str(data), "--model", str(model), "--out-dir", str(out),
               "--devices", str(devices), *SMALL, *EXACT, *flags]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return f"exit {done.returncode}: {lines[-1][:150] if lines else 'no output'}"
    return None


def check_export(folder: Path, rows: Path, reference: dict | None) -> str | None:
    """What is wrong with the export in ``folder``, or None."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    import predict

    model, info = AutoModelForSequenceClassification.from_pretrained(folder, output_loading_info=True)
    if any(info.values()):
        return f"loads with {info}"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        batched = model.eval()(**tokenizer(TEXTS, padding=True, return_tensors="pt")).logits
        alone = torch.cat([model(**tokenizer([text], return_tensors="pt")).logits for text in TEXTS])
    if not torch.allclose(batched, alone, rtol=1e-4, atol=1e-5):
        return "one-row logits differ from batched ones"
    if reference is not None:
        weights = load_file(folder / "model.safetensors")
        if weights.keys() != reference.keys():
            return "exports other weights than one process"
        differ = [name for name, value in reference.items()
                  if not torch.allclose(weights[name], value, rtol=1e-4, atol=1e-5)]
        if differ:
            return f"{len(differ)} tensors differ from one process's, e.g. {differ[0]}"
    with open(predict.main([str(folder.parent), str(rows)])) as f:
        predicted = [int(row["predicted"]) for row in csv.DictReader(f)]
    if predicted != batched.argmax(dim=-1).tolist():
        return "predict.py predicts other classes"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma list of tests/families.py's")
    parser.add_argument("--report", help="write REPORT.json and REPORT.md")
    args = parser.parse_args()
    from safetensors.torch import load_file

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}, {when}")
    matrix = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data, _ = prepare_demo(tmp / "demo")
        rows = tmp / "rows.csv"
        rows.write_text("text\n" + "\n".join(TEXTS) + "\n")
        print(f"{'family':12s} " + " ".join(f"{run:>12s}" for run in RUNS))
        for family in args.families.split(","):
            model = write_family_model(family, tmp / family)
            cells, reference = {}, None
            for run, (flags, devices) in RUNS.items():
                out, start = tmp / f"{family}-{run}", time.perf_counter()
                problem = train(data, model, out, flags, devices)
                if problem is None:
                    problem = check_export(out / "model", rows, reference if devices > 1 else None)
                if run == "lora" and problem is None:
                    reference = load_file(out / "model" / "model.safetensors")
                cells[run] = {"ok": problem is None, "problem": problem, "seconds": round(time.perf_counter() - start)}
            matrix[family] = cells
            print(f"{family:12s} " + " ".join(f"{'ok' if c['ok'] else 'FAILED':>12s}" for c in cells.values()),
                  flush=True)
            for run, cell in cells.items():
                if not cell["ok"]:
                    print(f"  {run}: {cell['problem']}", flush=True)
    if args.report:
        report = Path(args.report)
        report.with_suffix(".json").write_text(json.dumps({"cpu": cpu, "started": when, "torch": torch.__version__,
                                                          "matrix": matrix}, indent=1))
        lines = [f"# Model families x runs (`python bench/families.py`), {cpu}, torch {torch.__version__}, {when}", "",
                 "| family | " + " | ".join(RUNS) + " |", "|---" * (len(RUNS) + 1) + "|"]
        lines += [f"| {family} | " + " | ".join("ok" if c["ok"] else f"failed: {c['problem']}" for c in cells.values())
                  + " |" for family, cells in matrix.items()]
        report.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
