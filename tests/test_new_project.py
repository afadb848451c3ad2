"""A new project made with `copier copy` holds the template alone, and `copier update` brings a later template change
into it while keeping the copier's own edits (.ci/run runs the new project's own CI)."""

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
    assert len(files) <= 45, f"{len(files)} files in a new project: {files}"


def test_update_brings_a_template_fix_and_keeps_the_copiers_edit(template, tmp_path):
    project = new_project(template, tmp_path / "project")
    task = project / "task.py"
    task.write_text(task.read_text() + "# the copier's own edit\n")
    sh(*GIT, "commit", "-qam", "my task", cwd=project)
    fix = template / "fabric_utils" / "errors.py"
    fix.write_text(fix.read_text() + "# a later template fix\n")
    sh(*GIT, "commit", "-qam", "a template fix", cwd=template)
    try:
        sh(str(COPIER), "update", "--quiet", "--defaults", cwd=project)
    finally:
        sh(*GIT, "reset", "-q", "--hard", "HEAD~1", cwd=template)  # the next test copies the template as it is
    assert task.read_text().endswith("# the copier's own edit\n")
    assert (project / "fabric_utils" / "errors.py").read_text().endswith("# a later template fix\n")
