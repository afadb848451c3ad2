"""The task-free helpers train.py calls, vendored (``copier update`` brings their fixes), one module per concern; a
module loads when train.py imports it, and a feature behind a flag (``--resume``, ``--batch-size auto``, ``--compile``,
``--precision fp8-mixed``, the trackers, a strategy's engine, MFU's FLOP count) only when that flag asks. Here only
what ``--help`` and a bad flag need, which answer before torch loads. ``strategy`` alone looks at the type of the
strategy in use."""

from fabric_utils.args import FP8, Config, build_parser, parse_flags  # the flags, then the run's read-only config
from fabric_utils.errors import UserError, exit_on_user_error  # bad input: one line saying what to change
from fabric_utils.task_spec import TaskSpec  # what a task gives the loop
