"""The README's recipes match the flags that exist."""

import re

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
