"""What a reader opens, in whole files (blank and comment lines included): train.py and the public contract
(fabric_utils/__init__.py, what the loop may call, and fabric_utils/task_spec.py, what a task gives); the loop
(train.py and every fabric_utils module it reaches through imports); and the files whose code one optimizer step runs,
traced in this process through a short run of the checkout's own task (its TEST_FLAGS) on one CPU, with the lines
of the functions it runs there.

    .venv/bin/python bench/reading_list.py [REPO]      # REPO: a checkout or a `git worktree` of another commit
"""

import ast
import contextlib
import io
import os
import runpy
import sys
import tempfile
import threading
from pathlib import Path

PACKAGE = "fabric_utils"
STEP = 5  # the optimizer step traced: past the first ones, which build and compile


def module_file(repo: Path, name: str) -> Path | None:
    path = repo / name.replace(".", "/")
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py") if path.with_suffix(".py").is_file() \
        else None


def imported_files(repo: Path, path: Path) -> list[Path]:
    """The ``PACKAGE`` modules ``path`` imports (absolute, relative, or a submodule named in ``from PACKAGE import``),
    each with the package's ``__init__.py``, which Python runs first."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = path.relative_to(repo).with_suffix("").parts[:-node.level] if node.level else ()
            module = ".".join([*parts, *([node.module] if node.module else [])])
            names += [module, *(f"{module}.{alias.name}" for alias in node.names)]
    found = []
    for name in names:
        if name.split(".")[0] == PACKAGE:
            for parent in [PACKAGE, name]:
                if (file := module_file(repo, parent)) and file not in found:
                    found.append(file)
    return found


def reached_files(repo: Path, start: Path) -> list[Path]:
    """``start`` and every ``PACKAGE`` module it imports, directly or through another one, in the order found."""
    files, todo = [start], [start]
    while todo:
        for path in imported_files(repo, todo.pop(0)):
            if path not in files:
                files.append(path)
                todo.append(path)
    return files


def one_step_code(repo: Path) -> dict[Path, set[int]]:
    """The checkout's files (not its tests or bench) whose Python code runs from the end of optimizer step ``STEP`` to
    the end of the next (the rest of that step, the next batch, forward, backward and the step), each with the lines
    of the functions that run there."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    root, steps, code = str(repo) + os.sep, 0, set()

    def ours(frame) -> bool:
        path = frame.f_code.co_filename
        return path.startswith(root) and Path(path).relative_to(repo).parts[0] not in ("tests", "bench", ".venv")

    def profile(frame, event, arg):
        if event == "call" and ours(frame):
            code.add(frame.f_code)

    def on_step(optimizer, args, kwargs):
        nonlocal steps
        steps += 1
        if steps == STEP:  # the loop, the innermost of the checkout's functions running, runs on into the next step
            frame = sys._getframe(1)
            while not ours(frame):
                frame = frame.f_back
            code.add(frame.f_code)
        hook = profile if steps == STEP else None
        sys.setprofile(hook)
        threading.setprofile(hook)

    handle = register_optimizer_step_post_hook(on_step)
    sys.path.insert(0, str(repo))
    import task

    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
        sys.argv = ["train.py", *task.TEST_FLAGS, "--accelerator", "cpu", "--devices", "1", "--num-workers", "0",
                    "--max-steps", str(STEP + 2), "--quiet", "--out-dir", out]
        runpy.run_path(str(repo / "train.py"), run_name="__main__")
    handle.remove()
    reached = {}
    for function in code:
        numbers = [line for *_, line in function.co_lines() if line]
        reached.setdefault(Path(function.co_filename), set()).update(range(function.co_firstlineno, max(numbers) + 1))
    return dict(sorted(reached.items()))


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def main(repo: Path) -> None:
    public = [repo / "train.py", *(repo / PACKAGE / name for name in ("__init__.py", "task_spec.py"))]
    for title, files in (("train.py and the public contract", public),
                         ("the loop", reached_files(repo, repo / "train.py"))):
        print(f"{title}: {sum(map(lines, files)):,} lines in {len(files)} files")
        for path in files:
            print(f"  {lines(path):5d}  {path.relative_to(repo)}")
    step = one_step_code(repo)
    print(f"one optimizer step (step {STEP + 1}) runs {sum(map(len, step.values())):,} lines of functions in "
          f"{len(step)} files")
    for path, numbers in step.items():
        print(f"  {len(numbers):5d}  {path.relative_to(repo)} (of {lines(path)})")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]).resolve())
