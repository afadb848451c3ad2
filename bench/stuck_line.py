"""The stuck-at-chance line, judged again on finished runs: for each run folder under the given folders (any with
config.yaml, results.json and a CSV log), its training loss over the last quarter and its final validation loss as
shares of chance level, its test metric, and whether train.py's rule (fabric_utils/progress.py) would say the line
now. Chance level is what the run's own task computes from its config (``TaskSpec.chance_loss``), whatever task.py
is. For choosing the rule's thresholds on runs
kept by bench/study.py and bench/task_suite.py, without training again.

    python bench/stuck_line.py runs/task_suite runs/study33c
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import task  # noqa: E402
from fabric_utils.args import build_parser  # noqa: E402
from fabric_utils.loggers import read_metrics  # noqa: E402
from fabric_utils.progress import STUCK_WITHIN, at_chance, last_quarter_mean  # noqa: E402
from train import flag_parser, parse_args  # noqa: E402

LOOP_FLAGS = {action.dest for action in build_parser("")._actions}
# what decides a task's rows: its own flags (those train.py adds to the loop's) and the seed
DRAW_FLAGS = sorted({action.dest for action in flag_parser()._actions} - LOOP_FLAGS | {"seed"})


def judge(run: Path, task_cache: dict) -> dict | None:
    """One run's row: its losses as shares of chance, its test metric and whether the line is said; None where its
    task gives no chance level (``chance_loss`` is optional), as train.py then says no line either."""
    args = parse_args(["--config", str(run / "config.yaml")])
    draw = repr([getattr(args, flag) for flag in DRAW_FLAGS])
    if draw not in task_cache:  # the same rows, the same chance: load and tokenize each draw once
        spec = task.setup(args, verbose=False)
        task_cache[draw] = spec.chance_loss, f"test_{spec.objective.best_metric}"
    chance, metric = task_cache[draw]
    if chance is None:
        return None
    logged = read_metrics(run)
    train_losses, val_losses = logged["train/loss"].dropna().tolist(), logged["val/loss"].dropna().tolist()
    results = json.loads((run / "results.json").read_text())
    return {"run": run, "lr": args.lr, "train": last_quarter_mean(train_losses) / chance["train"],
            "validation": val_losses[-1] / chance["validation"], "metric": metric, "test": results[metric],
            "said": at_chance(train_losses, val_losses[-1], chance)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("folders", nargs="+", type=Path, help="folders searched for finished runs")
    args = p.parse_args()
    runs = sorted({log.parents[2] for folder in args.folders for log in folder.rglob("logs/version_*/metrics.csv")
                   if (log.parents[2] / "results.json").exists()})
    cache = {}
    rows = sorted(filter(None, (judge(run, cache) for run in runs)), key=lambda row: row["train"])
    print(f"the line needs training ≥ {STUCK_WITHIN['train']:.0%} and validation ≥ {STUCK_WITHIN['validation']:.0%} "
          f"of chance; {sum(row['said'] for row in rows)} of {len(rows)} runs get it"
          + (f" ({len(runs) - len(rows)} runs left out: their task gives no chance level)" if len(rows) < len(runs)
             else "") + "\n")
    print("| run | peak lr | training ÷ chance | validation ÷ chance | test | line |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['run']} | {row['lr']:.3g} | {row['train']:.3f} | {row['validation']:.3f} | "
              f"{row['metric'].removeprefix('test_')} {row['test']:.3f} | {'yes' if row['said'] else ''} |")


if __name__ == "__main__":
    main()
