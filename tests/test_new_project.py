"""A new project made with `copier copy` holds the template alone, and its README's update command brings a later
template change into it, past a release tag, while keeping the copier's own edits, and fails naming each file where
they conflict (.ci/run runs the new project's own CI)."""

import contextlib
import filecmp
import re
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from test_readme import check_parses, commands

COPIER = Path(REPO / ".venv" / "bin" / "copier")
# what only the lab needs: a new project never holds it
LAB = ("bench", "docs", "copier.yml", "template", "requirements-bench.txt", "tests/test_", "tests/cluster.py")
GIT = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost"]


def sh(*command, cwd):
    return subprocess.run(command, cwd=cwd, check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A clone of this repository with the working tree's changes committed: the template as it is now."""
    clone = tmp_path_factory.mktemp("template")
    sh("git", "clone", "-q", "--local", str(REPO), str(clone), cwd=REPO)
    sh("bash", "-c", f"git diff HEAD --binary | git -C {clone} apply --allow-empty", cwd=REPO)
    for path in sh("git", "ls-files", "--others", "--exclude-standard", cwd=REPO).stdout.split():
        (clone / path).parent.mkdir(parents=True, exist_ok=True)
        (clone / path).write_bytes((REPO / path).read_bytes())
    sh(*GIT, "add", "-A", cwd=clone)
    sh(*GIT, "commit", "-qm", "the working tree", "--allow-empty", cwd=clone)
    return clone


def new_project(template: Path, dest: Path) -> Path:
    sh(str(COPIER), "copy", "--quiet", "--defaults", "--data", "project_name=digits", str(template), str(dest),
       cwd=dest.parent)
    sh("git", "init", "-q", cwd=dest)
    sh(*GIT, "add", "-A", cwd=dest)
    sh(*GIT, "commit", "-qm", "new project", cwd=dest)
    return dest


def test_a_new_project_holds_the_template_alone(template, tmp_path):
    project = new_project(template, tmp_path / "project")
    files = sorted(str(p.relative_to(project)) for p in project.rglob("*") if p.is_file() and ".git" not in p.parts)
    assert not [f for f in files if f.startswith(LAB)], "lab files reached the new project"
    for name in ("train.py", "task.py", "examples/vision_task.py", "fabric_utils/task_spec.py", "tests/infra",
                 "scripts/setup.sh", "scripts/slurm.sbatch", ".ci/run", "requirements.txt"):
        assert any(f == name or f.startswith(name + "/") for f in files), f"{name} is missing from the new project"
    # every copied file is the template's own, and none is a link back into the template
    assert not [p for p in project.rglob("*") if p.is_symlink()]
    copied = [f for f in files if (template / "template" / f).exists() and f != ".gitignore"]
    assert copied and all(filecmp.cmp(project / f, template / "template" / f, shallow=False) for f in copied)
    readme = (project / "README.md").read_text()
    assert readme.startswith("# digits\n")
    for words in commands(readme):  # its commands as written, from the new project's root
        assert (project / words[0]).exists() or words[0].startswith(".venv/bin/"), words
        check_parses(words)
    named = {span.rstrip("/") for span in re.findall(r"`([\w./-]+/[\w./-]*|\w+\.(?:py|txt|yml))`", readme)}
    assert named and [name for name in named if not (project / name).exists()] == []
    assert "_commit:" in (project / ".copier-answers.yml").read_text()
    assert len(files) <= 55, f"{len(files)} files in a new project: {files}"


def update(project: Path) -> subprocess.CompletedProcess:
    """The new project's README's update command, as written, from its root (with this venv's copier)."""
    (line,) = [line for line in (project / "README.md").read_text().splitlines()
               if line.startswith(".venv/bin/copier update")]
    if not (project / ".venv").exists():
        (project / ".venv").symlink_to(REPO / ".venv")  # the project's .gitignore leaves it out of its tree
    return subprocess.run(["bash", "-c", line], cwd=project, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=120)


@contextlib.contextmanager
def published(template: Path, path: str, edit):
    """A template fix to ``path``, committed; the next test copies the template as it was."""
    fix = template / path
    fix.write_text(edit(fix.read_text()))
    sh(*GIT, "commit", "-qam", "a template fix", cwd=template)
    try:
        yield
    finally:
        sh(*GIT, "reset", "-q", "--hard", "HEAD~1", cwd=template)


def test_update_brings_a_fix_published_after_a_release_and_keeps_the_copiers_edit(template, tmp_path):
    """copier picks a template's newest release tag unless told a ref: the README's command follows the default
    branch, so a fix committed after a release still arrives."""
    sh(*GIT, "tag", "v1.0.0", cwd=template)
    try:
        project = new_project(template, tmp_path / "project")
        assert "_commit: v1.0.0" in (project / ".copier-answers.yml").read_text()  # a copy of the release
        task, mine = project / "task.py", project / "notes.md"
        task.write_text(task.read_text() + "# the copier's own edit\n")
        mine.write_text("a file the copier added\n")
        sh(*GIT, "add", "-A", cwd=project)
        sh(*GIT, "commit", "-qm", "my task", cwd=project)
        with published(template, "fabric_utils/errors.py", lambda text: text + "# a later template fix\n"):
            sh(str(COPIER), "update", "--quiet", "--defaults", cwd=project)  # copier's default: the newest tag
            assert "# a later template fix" not in (project / "fabric_utils" / "errors.py").read_text()
            done = update(project)
    finally:
        sh(*GIT, "tag", "-d", "v1.0.0", cwd=template)
    assert done.returncode == 0, done.stderr
    assert task.read_text().endswith("# the copier's own edit\n") and mine.read_text() == "a file the copier added\n"
    assert (project / "fabric_utils" / "errors.py").read_text().endswith("# a later template fix\n")


def test_update_names_each_conflicted_file_and_fails_until_it_is_resolved(template, tmp_path):
    """The copier and the template change the same line of train.py: copier leaves both in the file between
    markers and exits 0; the README's command names train.py and fails, again after a commit that kept the
    markers, until they are gone."""
    project = new_project(template, tmp_path / "project")
    loop = project / "train.py"
    first, rest = loop.read_text().split("\n", 1)
    loop.write_text(f"{first[:3]}The copier's own first line.\n{rest}")
    sh(*GIT, "commit", "-qam", "my loop", cwd=project)
    with published(template, "train.py", lambda text: f"{first[:3]}The template's fixed first line.\n{rest}"):
        done = update(project)
        assert done.returncode == 1 and done.stdout.splitlines() == ["train.py"], done.stdout + done.stderr
        assert loop.read_text().splitlines()[:5] == [  # as the README says: yours first, then the template's
            "<<<<<<< before updating", f"{first[:3]}The copier's own first line.", "=======",
            f"{first[:3]}The template's fixed first line.", ">>>>>>> after updating"]
        sh(*GIT, "add", "-A", cwd=project)
        sh(*GIT, "commit", "-qm", "the update, its conflict left in", cwd=project)
        again = update(project)
        assert again.returncode == 1 and again.stdout.splitlines() == ["train.py"], again.stdout + again.stderr
        loop.write_text(f"{first[:3]}The template's fixed first line.\n{rest}")  # resolved: the template's line kept
        sh(*GIT, "commit", "-qam", "the conflict resolved", cwd=project)
        done = update(project)
    assert done.returncode == 0, done.stdout + done.stderr
    assert loop.read_text().startswith(f"{first[:3]}The template's fixed first line.\n")
