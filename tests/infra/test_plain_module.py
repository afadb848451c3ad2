"""fabric_utils is task-agnostic: a plain torch module with its own loss trains, checkpoints and resumes exactly
through it on 2 CPU processes, and none of it imports transformers."""

import ast
import json
import sys

import pytest

from conftest import REPO, run

JOB = "tests/infra/plain_module_job.py"  # from the repository root, where conftest.run runs it


@pytest.mark.parametrize("strategy", ["ddp"])
def test_plain_module_trains_and_resumes_exactly_on_two_processes(tmp_path, strategy):
    common = ["--devices", "2", "--strategy", strategy, "--steps", "8"]
    run([sys.executable, JOB, str(tmp_path / "full"), *common])
    run([sys.executable, JOB, str(tmp_path / "resumed"), *common, "--stop-after", "4"])
    assert (tmp_path / "resumed" / "checkpoints" / "step-000004").is_dir()
    run([sys.executable, JOB, str(tmp_path / "resumed"), *common, "--resume"])
    full = json.loads((tmp_path / "full" / "result.json").read_text())
    resumed = json.loads((tmp_path / "resumed" / "result.json").read_text())
    assert full["world_size"] == 2 and full["mfu"] > 0
    assert resumed["checksum"] == pytest.approx(full["checksum"], rel=1e-6)
    assert resumed["loss"] == pytest.approx(full["loss"], rel=1e-6)
    assert resumed["lr"] == pytest.approx(full["lr"])


def test_fabric_utils_imports_no_task_library():
    """Infrastructure is handed the model or a callable; only task.py and data/ import transformers and datasets."""
    found = []
    for path in sorted((REPO / "fabric_utils").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("transformers", "datasets", "peft")]
    assert found == []
