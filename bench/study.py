"""Accuracy and time-to-accuracy study: configurations x seeds x data settings through train.py, one
process at a time, summarised as markdown tables.

    python bench/study.py --configs article,default,lr2e-4 --seeds 1,2,3 --train-sizes 600
    python bench/study.py --configs article,default --train-sizes 2000 --epochs 3 --max-length 512
    python bench/study.py --configs default,article --seeds 1,2,3,4,5 --val-size 120 --test-size 400 \
        --precision 32-true --vals-per-epoch 0 --report docs/studies/study_NAME   # Raschka's protocol

Each run validates about --vals-per-epoch times per epoch and logs every step, so its metrics.csv holds the
training clock ("time", from the throughput monitor, which stops during validations and checkpoints) at every step
and the validation accuracy at every validation: "train s" and "time to target" are training time only.
The target is the mean final validation accuracy of the --target configuration (the article's recipe) in the same
data setting. Runs whose results.json exists are not run again: the study can be stopped and continued.

What is tested: train.py tests the checkpoint with the best validation accuracy. With --vals-per-epoch N > 0 that is
the best of about N validations per epoch (a selection on the validation rows, which the article does not make);
with --vals-per-epoch 0 train.py validates at each epoch's end only, so a 1-epoch run tests its final model, as the
article does. Every configuration of one study is evaluated the same way.

Draws: the seed picks the rows. train.py carves the validation rows from IMDB's train split (``--val-size`` of them,
by seed), draws ``--train-size`` rows from the rest and ``--test-size`` from the test split, all by seed: every
configuration run on one seed sees the same rows, and a different --val-size gives different training rows for the
same seed. The report records a fingerprint of each draw's rows.

It studies the text task as shipped: its flags, and the fingerprint reads the rows with data/sources.py's loader.
"""

import argparse
import csv
import json
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.run_bench import DEFAULT_DATASET, article, default_model, fmt, machine, run_process  # noqa: E402
from fabric_utils.launcher import auto_precision  # noqa: E402
from train import flag_parser  # noqa: E402

# name -> train.py flags on top of the study's common ones; "default" is whatever fabric_utils/args.py says now, the
# other names spell out every setting they study, so their meaning does not change with the defaults
CONFIGS = {
    # the article's recipe: every row padded to --max-length, no length grouping, plain Adam (no weight decay) at a
    # fixed 5e-5 (no warm-up, no decay), batch 12, the model's hidden and attention dropout, 32-true, no clipping.
    # Its --precision 32-true comes after the study's --precision, so it stays fp32 in a bf16-mixed study
    "article": article(batch_size="12", lr="5e-5"),
    "default": [],
    # bench/hf_trainer.py (its flags here): with train.py's defaults (same model settings, same precision), and with
    # the Trainer's own defaults (what a user who picks the Trainer gets)
    "hf-trainer": [],
    "hf-own": ["--own-defaults"],
}
TRAINER_ROWS = {"hf-trainer", "hf-own"}
for lr in ("5e-5", "1e-4", "2e-4", "3e-4"):
    for warmup in ("0", "0.06", "0.1"):
        for scheduler in ("linear", "constant", "cosine"):
            CONFIGS[f"lr{lr}-w{warmup}-{scheduler}"] = ["--lr", lr, "--warmup", warmup, "--scheduler", scheduler,
                                                        "--batch-size", "16"]
        for batch in ("8", "32"):
            CONFIGS[f"lr{lr}-w{warmup}-b{batch}"] = ["--lr", lr, "--warmup", warmup, "--scheduler", "linear",
                                                     "--batch-size", batch]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", required=True, help="comma list of names, or 'list' to print them; a name may be "
                   "extended with '+FLAGS' in quotes, e.g. 'default+--lr 1e-4'")
    p.add_argument("--seeds", default="1,2,3", help="comma list (the seed also draws the data subset)")
    p.add_argument("--orders", type=int, default=1, help="runs per draw and configuration, each with another "
                   "--seed (batch order, head init, dropout) on the draw's rows (--data-seed); a draw's accuracy "
                   "and time are their mean. Order 1 is the draw's own seed")
    p.add_argument("--train-sizes", default="600", help="comma list of training-row counts")
    p.add_argument("--val-size", type=int, default=120)
    p.add_argument("--test-size", type=int, default=241)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--vals-per-epoch", type=int, default=4, help="validations per epoch (the best is tested); 0: "
                   "at each epoch's end only, so a 1-epoch run tests its final model (the article's protocol)")
    p.add_argument("--precision", help="train.py --precision for every configuration that does not set its own "
                   "(the article keeps 32-true); default: train.py's auto")
    p.add_argument("--target", default="article", help="configuration whose mean final val acc is the target")
    p.add_argument("--dataset", default=DEFAULT_DATASET)
    p.add_argument("--model", default=None, help="default: all-MiniLM-L6-v2 from requirements-bench.txt")
    p.add_argument("--extra", default="", help="data flags added to every run, train.py's and the Trainer's "
                   "(e.g. '--text-column sentence')")
    p.add_argument("--runs-dir", default=str(ROOT / "runs" / "study"))
    p.add_argument("--summarise-only", action="store_true", help="run nothing: tabulate the runs already done")
    p.add_argument("--fingerprint", action="store_true", help="record a hash of each draw's train / validation / "
                   "test rows in the report (the rows every configuration of that seed trains and is tested on)")
    p.add_argument("--report", help="also write the tables and raw numbers to REPORT.md / REPORT.json")
    return p.parse_args(argv)


def runs_hf_trainer(name: str) -> bool:
    return name.partition("+")[0] in TRAINER_ROWS


def config_flags(name: str) -> list[str]:
    """The configuration's flags, for train.py (or, for a Trainer row, for bench/hf_trainer.py)."""
    base, _, extra = name.partition("+")
    return CONFIGS[base] + extra.split()


def flag_value(flags: list[str], flag: str, default):
    return flags[flags.index(flag) + 1] if flag in flags else default


def run_draw(name: str, seed: int, train_size: int, args) -> dict | None:
    """A configuration on one draw: its --orders runs, with test and final validation accuracy and training seconds
    averaged over them (each run's in "orders"); None if one is not done yet under --summarise-only."""
    runs = [run_one(name, seed, order, train_size, args) for order in range(1, args.orders + 1)]
    if None in runs:
        return None
    failed = next((r for r in runs if "failed" in r), None)
    if failed or len(runs) == 1:
        return failed or runs[0]
    mean = {key: statistics.mean(r[key] for r in runs) for key in ("test_acc", "final_val_acc", "train_s")}
    return runs[0] | mean | {"orders": [{key: r[key] for key in mean} for r in runs]}


def run_one(name: str, seed: int, order: int, train_size: int, args) -> dict | None:
    """One run (skipped if its results.json exists), with its validation curve and training clock; None for a run
    not done yet under --summarise-only."""
    flags = config_flags(name)
    batch = int(flag_value(flags, "--batch-size", flag_parser().get_default("batch_size")))
    steps_per_epoch = -(-train_size // batch)
    val_every = max(1, round(steps_per_epoch / args.vals_per_epoch)) if args.vals_per_epoch > 0 else None
    out_dir = run_dir(name, seed, order, train_size, args)
    hf_trainer = runs_hf_trainer(name)
    if (out_dir / "results.json").exists():
        results = json.loads((out_dir / "results.json").read_text())
    elif args.summarise_only:
        return None
    else:
        shutil.rmtree(out_dir, ignore_errors=True)  # a run the study's stop cut short: train.py refuses its folder
        common = ["--dataset", args.dataset, "--model", args.model or default_model(), "--train-size", str(train_size),
                  "--val-size", str(args.val_size), "--test-size", str(args.test_size),
                  "--max-length", str(args.max_length), "--epochs", str(args.epochs),
                  "--seed", str(seed + 1000 * (order - 1)), *(["--data-seed", str(seed)] if order > 1 else []),
                  "--num-workers", "0", "--out-dir", str(out_dir)]
        if args.precision and not hf_trainer:  # before the configuration's flags: a configuration's own wins
            common += ["--precision", args.precision]
        if hf_trainer:  # validates once per epoch only; the precision train.py would run in
            cmd = [sys.executable, "bench/hf_trainer.py", *common, *flags, *args.extra.split()]
            cmd += ["--bf16"] if run_precision(name, args) == "bf16-mixed" else []
        else:
            cmd = [sys.executable, "train.py", *common, "--quiet", "--log-every", str(getattr(args, "log_every", 1)),
                   *(["--val-every", str(val_every)] if val_every else []), *flags, *args.extra.split()]
        results = run_process(cmd, out_dir)
        if "failed" in results:
            return results
        for bulky in ("checkpoints", "model"):  # hundreds of MB a run (a study filled a disk); the study reads
            shutil.rmtree(out_dir / bulky, ignore_errors=True)  # results.json and the logs
    metric = getattr(args, "metric", "acc")  # the task's: acc, f1 or pearson (bench/task_suite.py)
    if hf_trainer:  # one validation, at the end of each epoch: the curve's last point only
        curve = [(results["steps"], results["train_time_s"], results[f"val_{metric}"])]
        return results | {"curve": curve, "train_s": results["train_time_s"], "final_val_acc": results[f"val_{metric}"]}
    metrics_csv = max(out_dir.glob("logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    return results | validation_curve(metrics_csv, metric)


def run_precision(name: str, args) -> str:
    """The precision a configuration's runs compute in: its own --precision, else the study's, else auto's."""
    if runs_hf_trainer(name):  # --bf16 or not, as train.py would decide
        return args.precision or auto_precision("auto")
    return flag_value(config_flags(name), "--precision", args.precision or auto_precision("auto"))


def run_dir(name: str, seed: int, order: int, train_size: int, args) -> Path:
    """One folder per run, named by everything that changes it: data sizes, length, epochs, precision, evaluation
    protocol and --extra (the article's fp32 runs are shared by an fp32 and a bf16-mixed study of the same draws), the
    draw and the order (order 1, the draw's own seed, keeps the name it had before --orders)."""
    setting = f"n{train_size}-v{args.val_size}-t{args.test_size}-L{args.max_length}-e{args.epochs}"
    setting += f"-{run_precision(name, args)}-vpe{args.vals_per_epoch}"
    if args.extra:
        setting += "-" + "_".join(args.extra.split()).replace("/", "_")
    return Path(args.runs_dir) / Path(args.dataset).name / setting / name.replace(" ", "_") / (
        f"seed{seed}" if order == 1 else f"seed{seed}-order{order}")


def draw_fingerprint(seed: int, train_size: int, args) -> dict:
    """A short hash of the text of each split's rows for this seed, as train.py draws them (the same call)."""
    import hashlib

    from data.sources import load_splits

    extra = flag_parser().parse_args(args.extra.split())
    splits = load_splits(args.dataset, extra.text_column, extra.label_column, seed, train_size, args.val_size,
                         args.test_size).splits
    return {name: hashlib.sha256("\0".join(sorted(split[extra.text_column])).encode()).hexdigest()[:12]
            for name, split in splits.items()}


def validation_curve(metrics_csv: Path, metric: str = "acc") -> dict:
    """From metrics.csv: [(step, training seconds, val ``metric``)] at each validation, and training seconds to the
    last step. The logged "time" is the throughput monitor's training clock, which leaves validations and checkpoints
    out."""
    clock, val_acc = {}, {}
    with open(metrics_csv) as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            if row.get("time"):
                clock[step] = float(row["time"])
            if row.get(f"val/{metric}"):
                val_acc[step] = float(row[f"val/{metric}"])
    # the clock at the first log step at or after each validation (a later one than the validation's own step where
    # the run logs every N > 1 steps: the time to a target is not understated)
    curve = [(step, clock[min((s for s in clock if s >= step), default=max(clock))], acc)
             for step, acc in sorted(val_acc.items())]
    return {"curve": curve, "train_s": clock[max(clock)], "final_val_acc": curve[-1][2]}


def spread(values: list[float], spec: str) -> str:
    """mean ± standard deviation (min–max)."""
    if not values:
        return "—"
    if len(values) == 1:
        return format(values[0], spec)
    return (f"{format(statistics.mean(values), spec)} ± {format(statistics.stdev(values), spec)} "
            f"({format(min(values), spec)}–{format(max(values), spec)})")


def summarise(setting: str, by_config: dict[str, list[dict]], target_name: str) -> tuple[str, dict]:
    ok = {name: [r for r in runs if "failed" not in r] for name, runs in by_config.items()}
    target_runs = ok.get(target_name) or []
    target = statistics.mean(r["final_val_acc"] for r in target_runs) if target_runs else None
    reference_s = statistics.mean(r["train_s"] for r in target_runs) if target_runs else None
    lines = [f"**{setting}**; target val acc {fmt(target, '.3f')} (mean final val acc of '{target_name}')", "",
             "| configuration | runs | steps | test acc | final val acc | train s | time to target s (reached) "
             "| train-time speed-up |", "|" + "---|" * 8]
    rows = {}
    for name, runs in ok.items():
        failed = len(by_config[name]) - len(runs)
        if not runs:
            lines.append(f"| {name} | 0 ({failed} failed) |" + " — |" * 6)
            continue
        reach = [next((t for _, t, acc in r["curve"] if acc >= target), None) for r in runs] if target else []
        reached = [t for t in reach if t is not None]
        train_s = statistics.mean(r["train_s"] for r in runs)
        rows[name] = {"test_acc": [r["test_acc"] for r in runs], "final_val_acc": [r["final_val_acc"] for r in runs],
                      "train_s": [r["train_s"] for r in runs], "time_to_target_s": reach, "steps": runs[0]["steps"],
                      "seeds": [r["config"]["seed"] for r in runs] if "config" in runs[0] else None,
                      "precision": runs[0].get("precision")}
        lines.append(
            f"| {name} | {len(runs)}{f' ({failed} failed)' if failed else ''} | {runs[0]['steps']} "
            f"| {spread(rows[name]['test_acc'], '.3f')} | {spread(rows[name]['final_val_acc'], '.3f')} "
            f"| {spread(rows[name]['train_s'], '.0f')} | {spread(reached, '.0f')} ({len(reached)}/{len(runs)}) "
            f"| {fmt(reference_s / train_s if reference_s else None, '.2f')}x |")
    if target_name in rows:
        lines += ["", against_target(rows, target_name), "", per_draw(rows)]
    return "\n".join(lines), {"target_val_acc": target, "rows": rows}


def against_target(rows: dict, target_name: str) -> str:
    """The bar for a faster default, on the draws both configurations finished: mean test acc >= the target's mean
    - 0.01, worst draw >= the target's worst - 0.02, and the training-time ratio (mean seconds of the target over the
    configuration's; the bar is 1.5x in fp32, 2.5x in bf16-mixed where the CPU computes bf16 natively)."""
    ref = rows[target_name]
    lines = [f"| configuration | draws | mean test acc | worst draw | mean − {target_name}'s | worst − {target_name}'s "
             f"| draws below {target_name} | {target_name} ÷ config, train s |", "|" + "---|" * 8]
    for name, row in rows.items():
        paired = paired_draws(row, ref)
        if not paired:
            continue
        acc, ref_acc = [a for a, _, _, _ in paired], [b for _, b, _, _ in paired]
        ratio = statistics.mean(t for _, _, _, t in paired) / statistics.mean(t for _, _, t, _ in paired)
        lines.append(f"| {name} | {len(paired)} | {statistics.mean(acc):.3f} | {min(acc):.3f} "
                     f"| {statistics.mean(acc) - statistics.mean(ref_acc):+.3f} | {min(acc) - min(ref_acc):+.3f} "
                     f"| {sum(a < b for a, b in zip(acc, ref_acc))} | {ratio:.2f}x |")
    return "\n".join(lines)


def paired_draws(row: dict, ref: dict) -> list[tuple]:
    """(test acc, the reference's test acc, train s, the reference's train s) on the seeds both have."""
    if not row["seeds"] or not ref["seeds"]:
        return []
    theirs = {seed: (acc, t) for seed, acc, t in zip(ref["seeds"], ref["test_acc"], ref["train_s"])}
    return [(acc, theirs[seed][0], t, theirs[seed][1])
            for seed, acc, t in zip(row["seeds"], row["test_acc"], row["train_s"]) if seed in theirs]


def per_draw(rows: dict) -> str:
    """Test accuracy by draw (seed), configurations side by side."""
    seeds = sorted({seed for row in rows.values() for seed in row["seeds"] or []})
    lines = ["| draw (seed) | " + " | ".join(rows) + " |", "|" + "---|" * (len(rows) + 1)]
    for seed in seeds:
        cells = [next((f"{acc:.3f}" for s, acc in zip(row["seeds"] or [], row["test_acc"]) if s == seed), "—")
                 for row in rows.values()]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.configs == "list":
        print("\n".join(f"{k}: {' '.join(v)}" for k, v in CONFIGS.items()))
        return
    names = args.configs.split(",")
    if args.target not in names:
        names.append(args.target)
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"machine: {machine()}", flush=True)
    tables, raw, draws = [], {}, {}
    for train_size in (int(n) for n in args.train_sizes.split(",")):
        setting = (f"{Path(args.dataset).name}, {train_size} train / {args.val_size} val / {args.test_size} test rows, "
                   f"length {args.max_length}, {args.epochs} epoch(s), seeds {args.seeds}"
                   + (f", --precision {args.precision}" if args.precision else "")
                   + (f", {args.orders} orders per draw (mean)" if args.orders > 1 else "")
                   + (", final model tested" if args.vals_per_epoch == 0 and args.epochs == 1 else ""))
        by_config = {name: [] for name in names}
        draws[setting] = {}
        for seed in seeds:  # seed by seed, so a change in the machine's speed touches every configuration alike
            if args.fingerprint:
                draws[setting][seed] = draw_fingerprint(seed, train_size, args)
            for name in names:
                if result := run_draw(name, seed, train_size, args):
                    by_config[name].append(result)
        text, raw[setting] = summarise(setting, by_config, args.target)
        print(text, flush=True)
        tables.append(text)
    if args.report:
        # the name as given plus the suffix: a rate in it (lr1.2e-4) holds a dot that with_suffix would cut at
        Path(f"{args.report}.md").write_text("\n\n".join(tables) + "\n")
        Path(f"{args.report}.json").write_text(json.dumps({"args": vars(args), "machine": machine(), "results": raw,
                                                           "draws": draws}, indent=1))


if __name__ == "__main__":
    main()
