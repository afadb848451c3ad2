"""What a reader carries: the checkout's files a default run imports (counted by running it and listing, at exit, the
project files in its ``sys.modules``), in code lines (no blank, comment or docstring lines), per module, with those of
them the run executed (the rest: error paths and other set-ups' branches); the fabric_utils modules it does not import
(optional: loaded when a flag asks) beside them; and the files whose code one optimizer step runs, traced in this
process through a short run of the checkout's own task (its TEST_FLAGS) on one CPU, with the lines of the functions it
runs there.

    .venv/bin/python bench/reading_list.py [REPO]      # REPO: a checkout or a `git worktree` of another commit
"""

import ast
import contextlib
import io
import json
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import tokenize
from pathlib import Path

PACKAGE = "fabric_utils"
STEP = 5  # the optimizer step traced: past the first ones, which build and compile
RUNS = {"train.py --demo": ["--demo", "--max-steps", "2"],
        "rank 0 of --demo --devices 2 --strategy fsdp2": ["--demo", "--max-steps", "2", "--devices", "2",
                                                          "--strategy", "fsdp2"]}
# in the measured process: at exit, the checkout's files among the imported modules, each with the lines it ran there
# if traced (rank 0 alone records them, as Fabric starts the other ranks as plain `python train.py`)
RECORD = """
import atexit, json, os, runpy, sys, threading
repo, train, record, traced = sys.argv[1:5]
sys.path.insert(0, os.path.dirname(train))  # as `python train.py` puts it first
ran = {}
def trace(frame, event, arg):
    if not frame.f_code.co_filename.startswith(repo):
        return None
    lines = ran.setdefault(frame.f_code.co_filename, set())
    def line(frame, event, arg):
        if event == "line":
            lines.add(frame.f_lineno)
        return line
    return line
if traced == "lines":
    sys.settrace(trace)
    threading.settrace(trace)
def write():
    files = {getattr(module, "__file__", None) for module in list(sys.modules.values())}
    with open(record, "w") as out:
        json.dump({f: sorted(ran.get(f, ())) for f in files if f and f.startswith(repo)}, out)
atexit.register(write)
sys.argv = [train, *sys.argv[5:]]
runpy.run_path(train, run_name="__main__")
"""


def code_lines(path: Path) -> int:
    """Lines that hold code: not blank, not only a comment, not part of a module's, class's or function's docstring."""
    return len(code_line_numbers(path))


def code_line_numbers(path: Path) -> set[int]:
    text = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                     str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    code = set()
    layout = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in layout:
            code.update(range(token.start[0], token.end[0] + 1))
    return code - docstrings


def ran_lines(path: Path, started: set[int]) -> int:
    """Code lines of the statements that ran (whose first line ran): a simple one whole, a compound one its header."""
    ran = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.stmt, ast.ExceptHandler)) and node.lineno in started:
            blocks = [getattr(node, name, None) for name in ("body", "orelse", "handlers", "finalbody")]
            first = min([node.lineno, *(decorator.lineno for decorator in getattr(node, "decorator_list", []))])
            ran.update(range(first, min((block[0].lineno for block in blocks if block), default=node.end_lineno + 1)))
    return len(code_line_numbers(path) & ran)


def ours(repo: Path, path: Path) -> bool:
    """A file of the checkout's program: not its tests, benchmarks or virtual environment."""
    return path.is_relative_to(repo) and path.relative_to(repo).parts[0] not in ("tests", "bench", ".venv")


def imported_files(repo: Path, flags: list[str], lines: bool = False, timeout: float = 600) -> dict[Path, set[int]]:
    """The checkout's files that ``train.py flags`` imported, as its process (rank 0) held them at exit, each with the
    lines that process ran where ``lines`` (tracing them doubles the run's time)."""
    with tempfile.TemporaryDirectory() as out:
        record = Path(out) / "imported.json"
        subprocess.run([sys.executable, "-c", RECORD, str(repo) + os.sep, str(repo / "train.py"), str(record),
                        "lines" if lines else "", *flags, "--out-dir", str(Path(out) / "run")], cwd=out, check=True,
                       timeout=timeout, stdout=subprocess.DEVNULL)
        return {Path(path): set(ran) for path, ran in json.loads(record.read_text()).items()
                if ours(repo, Path(path))}


def one_step_code(repo: Path) -> dict[Path, set[int]]:
    """The checkout's files (not its tests or bench) whose Python code runs from the end of optimizer step ``STEP`` to
    the end of the next (the rest of that step, the next batch, forward, backward and the step), each with the lines
    of the functions that run there."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps, code = 0, set()

    def mine(frame) -> bool:
        return ours(repo, Path(frame.f_code.co_filename))

    def profile(frame, event, arg):
        if event == "call" and mine(frame):
            code.add(frame.f_code)

    def on_step(optimizer, args, kwargs):
        nonlocal steps
        steps += 1
        if steps == STEP:  # the loop, the innermost of the checkout's functions running, runs on into the next step
            frame = sys._getframe(1)
            while not mine(frame):
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


def main(repo: Path) -> None:
    package = sorted((repo / PACKAGE).glob("*.py"))
    imported = {title: imported_files(repo, flags, lines=True) for title, flags in RUNS.items()}
    name = {path: path.relative_to(repo).as_posix()
            for path in {*package, *(path for files in imported.values() for path in files)}}
    print(f"code lines (no blank, comment or docstring lines) of the files a default run imports, counted at exit "
          f"(rank 0), and in brackets those the run executed; {PACKAGE}/ has {sum(map(code_lines, package)):,} in "
          f"{len(package)} modules")
    print(" | ".join(["file", *imported]))
    for path in sorted(name, key=lambda path: (path.parent != repo, path.parts[-2] == PACKAGE, name[path])):
        cells = [f"{code_lines(path):,} ({ran_lines(path, files[path]):,})" if path in files else "-"
                 for files in imported.values()]
        print(" | ".join([name[path] + ("" if path.parent != repo / PACKAGE or any(path in files for files in
                                                                                    imported.values())
                                        else " (optional)"), *cells]))
    for title, where in ((PACKAGE, lambda path: path.parent == repo / PACKAGE), ("in all", lambda path: True)):
        print(" | ".join([f"**{title}**", *(f"**{sum(code_lines(p) for p in files if where(p)):,}** "
                                            f"({sum(ran_lines(p, lines) for p, lines in files.items() if where(p)):,}) "
                                            f"in {sum(map(where, files))} files" for files in imported.values())]))
    step = one_step_code(repo)
    print(f"one optimizer step (step {STEP + 1}) runs {sum(map(len, step.values())):,} lines of functions in "
          f"{len(step)} files")
    for path, numbers in step.items():
        print(f"  {len(numbers):5d}  {path.relative_to(repo)} (of {len(path.read_text().splitlines())})")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]).resolve())
