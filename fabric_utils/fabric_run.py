"""Under ``fabric run``: its launch settings, checked against train.py's flags; loaded only in its processes."""

import os

import psutil

from fabric_utils.args import LAUNCH_DEFAULTS
from fabric_utils.errors import UserError


def fabric_run_settings(flags: dict) -> dict:
    """``fabric run``'s settings (its ``LT_*`` variables); one also in ``flags`` with another value, or given to
    ``fabric run`` twice (it silently takes the last), is a ``UserError``."""
    settings = {name: os.environ[var] for name in LAUNCH_DEFAULTS if (var := f"LT_{name.upper()}") in os.environ}
    given = _fabric_run_options()
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if len(set(given.get(name, []))) > 1:
            raise UserError(f"{flag} is given to `fabric run` twice ({' and '.join(given[name])}), and it took the "
                            f"last ({value}) even if it came after train.py; give {flag} once")
        if flags.get(name) is not None and str(flags[name]) != value:
            raise UserError(f"{flag} is set twice: `fabric run` has {value} (its default if not given there) and "
                            f"train.py has {flags[name]}; remove {flag} from the train.py arguments")
    return settings


def _fabric_run_options() -> dict[str, list[str]]:
    """Each launch setting's values on the command line of this process's parent, torchrun's agent."""
    try:
        argv = psutil.Process(os.getppid()).cmdline()
    except psutil.Error:
        return {}
    values = {}
    for i, word in enumerate(argv):
        option, equals, value = word.partition("=")
        name = option.removeprefix("--").replace("-", "_")
        if option.startswith("--") and name in LAUNCH_DEFAULTS and (equals or i + 1 < len(argv)):
            values.setdefault(name, []).append(value if equals else argv[i + 1])
    return values
