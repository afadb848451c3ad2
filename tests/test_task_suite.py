"""bench/task_suite.py's task builders on tiny made-up articles (no corpus, no model): each label is what its
construction says, and the Trainer row's metrics match train.py's names and values."""

import random
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import hf_trainer, task_suite  # noqa: E402

TOPICS = ["sport", "business", "tech", "sport", "politics", "tech"]


def article(i: int, sentences: int = 6) -> str:
    """A headline, then two paragraphs of sentences that name their article and place."""
    body = [f"Story {i} sentence {j} says something quite long enough here." for j in range(sentences)]
    half = sentences // 2
    return f"Headline {i}\n\n" + " ".join(body[:half]) + "\n\n" + " ".join(body[half:])


ARTICLES = [article(i) for i in range(len(TOPICS))]


def stories(text: str) -> list[int]:
    """The article of each sentence in ``text``."""
    return [int(i) for i in re.findall(r"Story (\d+)", text)]


def test_position_takes_the_first_middle_or_last_sentence_in_turn():
    rows = task_suite.build_position(ARTICLES, random.Random(0)).to_pylist()
    assert len(rows) == len(ARTICLES)
    where = {"opening": "sentence 0 ", "middle": "sentence 3 ", "closing": "sentence 5 "}
    assert all(where[row["label"]] in row["text"] for row in rows)
    assert sorted(row["label"] for row in rows) == ["closing"] * 2 + ["middle"] * 2 + ["opening"] * 2


def test_pair_continues_its_own_review_or_another_in_turn():
    reviews = [" ".join(f"Review {i} part {j} is here." for j in range(4)) for i in range(6)]
    rows = task_suite.build_pair(reviews, random.Random(0)).to_pylist()
    assert [row["label"] for row in rows] == ["continues", "random"] * 3
    for row in rows:
        own = row["text"].split()[1]
        assert (row["text_b"].split()[1] == own) == (row["label"] == "continues")
        assert row["text"].count("part") == 2  # cut at the middle sentence boundary


def test_multilabel_rows_carry_their_paragraphs_topics():
    rows = task_suite.build_multilabel(ARTICLES, TOPICS, random.Random(0)).to_pylist()
    for row in rows:
        assert row["label"] == sorted({TOPICS[i] for i in stories(row["text"])})
    assert sum(len(stories(row["text"])) for row in rows) == 6 * len(ARTICLES)  # every paragraph once, both of each


def test_regression_target_is_the_share_of_sport_sentences():
    articles = [article(i, sentences=12) for i in range(len(TOPICS))]
    rows = task_suite.build_regression(articles, TOPICS, random.Random(0), per_row=3).to_pylist()
    assert rows
    for row in rows:
        assert row["label"] == pytest.approx(sum(TOPICS[i] == "sport" for i in stories(row["text"])) / 3)


@pytest.mark.parametrize("problem_type, logits, labels, expected", [
    ("single_label", [[2.0, 0.0], [0.0, 1.0], [3.0, 1.0]], [0, 1, 1], {"acc": 2 / 3}),
    ("multi_label", [[1.0, -1.0], [1.0, 1.0]], [[1.0, 0.0], [0.0, 1.0]], {"f1": 2 * 2 / (3 + 2),
                                                                          "exact_match": 0.5}),
    ("regression", [[0.0], [1.0], [2.0]], [0.0, 2.0, 4.0], {"rmse": np.sqrt(5 / 3), "pearson": 1.0}),
])
def test_trainer_metrics(problem_type, logits, labels, expected):
    got = hf_trainer.metrics_for(problem_type)(SimpleNamespace(predictions=np.array(logits),
                                                               label_ids=np.array(labels)))
    assert got == pytest.approx(expected)
