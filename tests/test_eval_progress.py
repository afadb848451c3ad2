"""A long validation or test is never silent: a bar on a terminal, lines with the time left in a log."""

import re
from types import SimpleNamespace

from fabric_utils.progress import counted


def test_an_evaluation_in_a_log_prints_its_progress_and_only_on_rank_0(capsys):
    batches = list(range(5))
    assert list(counted(SimpleNamespace(is_global_zero=True), batches, "test", every_s=0)) == batches
    lines = capsys.readouterr().out.splitlines()  # pytest's capture is no terminal: lines, as in a log
    assert len(lines) == 4 and all(re.fullmatch(rf"test: {i}/5 batches, \d+:\d\d:\d\d left", line)
                                   for i, line in enumerate(lines, start=1))
    assert list(counted(SimpleNamespace(is_global_zero=False), batches, "test", every_s=0)) == batches
    assert list(counted(SimpleNamespace(is_global_zero=True), batches, "test")) == batches  # under 30 s: no line
    assert capsys.readouterr().out == ""
