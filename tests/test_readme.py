"""The README's recipes match the flags that exist."""

import json
import re
import statistics

from conftest import REPO
from train import flag_parser


def test_every_flag_the_readme_gives_train_py_exists():
    readme = (REPO / "README.md").read_text()
    known = {option for action in flag_parser()._actions for option in action.option_strings}
    named = set()
    for line in readme.splitlines():
        if "train.py" in line:  # flags after train.py belong to it; before, to fabric run / torchrun / srun
            named |= set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line.split("train.py", 1)[1]))
        elif line.startswith("|") and "`--" in line:  # the flag tables
            named |= set(re.findall(r"`(--[a-z][a-z0-9-]*)", line))
    assert len(named) > 40
    assert named - known == set()


def test_quick_start_is_the_ci_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash scripts/setup.sh && .venv/bin/python train.py --demo" in readme
    assert ".venv/bin/python -m pytest -q" in readme and ".venv/bin/python -m pytest -q" in ci
    assert "bash scripts/setup.sh" in ci


def layout_paths(readme: str) -> list[str]:
    """The files and folders the README's layout table names (later names in a cell share the first one's folder)."""
    table = readme.split("Layout (purpose", 1)[1].split("\n\n", 2)[1]
    paths = []
    for line in table.splitlines()[2:]:
        names = re.findall(r"`([^`]+)`", line.split("|")[1])
        folder = names[0].rsplit("/", 1)[0] + "/" if "/" in names[0].rstrip("/") else ""
        paths += [names[0], *(folder + name for name in names[1:])]
    return paths


def test_the_layout_table_names_files_that_exist():
    """Names only: a copier's edit to a file must not fail a test over a figure in the README."""
    paths = layout_paths((REPO / "README.md").read_text())
    assert len(paths) > 10 and [path for path in paths if not (REPO / path).exists()] == []


def test_the_fault_table_names_tests_that_exist():
    """docs/studies/RESULTS.md's fault table (issue 18) says which test injects each fault: each must be there."""
    results = (REPO / "docs" / "studies" / "RESULTS.md").read_text()
    table = results[results.index("## Issue 18: fault table"):]
    named = re.findall(r"`(tests/[\w/]+\.py)::(test_\w+)`", table)
    assert len(named) > 20
    missing = [f"{path}::{name}" for path, name in named
               if not re.search(rf"^def {name}\(", (REPO / path).read_text(), re.MULTILINE)]
    assert not missing


def test_the_learning_rates_the_technique_table_states_are_the_tasks():
    from task import LR_BY_WIDTH

    rows = {line.split("|")[1].strip(): line for line in (REPO / "README.md").read_text().splitlines()
            if line.startswith("| ")}
    stated = [(float(lr), float(width)) for lr, width in re.findall(r"([\d.]+e-\d+) up to (\d+)", rows["schedule"])]
    stated.append((float(re.search(r"([\d.]+e-\d+) wider", rows["schedule"]).group(1)), float("inf")))
    assert stated == [(lr, width) for width, lr in LR_BY_WIDTH]


def test_the_speed_sections_issue_19_rows_are_the_studys_reports():
    """Each row of the README's issue-19 table names a bench/study.py report: its accuracies (mean and worst draw)
    and its time ratio (median draw) are recomputed from the report's per-draw numbers."""
    default = "default+--group-by-length --min-lr-rate 0.3"  # spelled out: the study's "default" runs predate it
    rows = [line.split("|")[2:-1] for line in (REPO / "README.md").read_text().splitlines()
            if re.match(r"\| [^|]+ \| `docs/studies/study_issue19_\w+\.json` \|", line)]
    assert len(rows) >= 3

    def accuracy(row: dict) -> str:
        return f"{statistics.mean(row['test_acc']):.3f} ({min(row['test_acc']):.3f})"

    for report, article_acc, default_acc, time in rows:
        (setting,) = json.loads((REPO / report.strip(" `")).read_text())["results"].values()
        article, ours = setting["rows"]["article"], setting["rows"][default]
        assert [article_acc.strip(), default_acc.strip()] == [accuracy(article), accuracy(ours)], report
        slow, fast = statistics.median(article["train_s"]), statistics.median(ours["train_s"])
        assert time.replace("*", "").strip().startswith(f"{slow / fast:.2f}x ({slow:.0f} s / {fast:.0f} s"), report
