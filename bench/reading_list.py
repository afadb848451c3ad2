"""Lines a reader opens to understand the loop (train.py and every fabric_utils module it reaches through imports) and
to write a new task (the contract and the example task), whole files, blank and comment lines included.

    .venv/bin/python bench/reading_list.py [REPO]      # REPO: a checkout or a `git worktree` of another commit
"""

import ast
import sys
from pathlib import Path


def reached_files(repo: Path, start: Path, package: str) -> list[Path]:
    """``start`` and every ``package`` module it imports, directly or through another one, in the order found."""
    files, todo = [start], [start]
    while todo:
        for node in ast.walk(ast.parse(todo.pop(0).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == package:
                path = repo / f"{node.module.replace('.', '/')}.py"
                if path not in files:
                    files.append(path)
                    todo.append(path)
    return files


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def main(repo: Path) -> None:
    loop = reached_files(repo, repo / "train.py", "fabric_utils")
    task = [repo / "fabric_utils" / "task_spec.py", repo / "examples" / "vision_task.py"]
    for title, files in (("the loop", loop), ("a new task", task)):
        print(f"{title}: {sum(map(lines, files)):,} lines in {len(files)} files")
        for path in files:
            print(f"  {lines(path):5d}  {path.relative_to(repo)}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]).resolve())
