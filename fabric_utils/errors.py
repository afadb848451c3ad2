"""User-facing errors: one line that says what to change, printed once, no traceback, a non-zero exit."""

import functools
import os
import sys

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad input from the user (flags, data, model, checkpoint, output folder)."""


def exit_on_user_error(main):
    """Turns a ``UserError`` into ``error: <message>`` on stderr and exit status 2. Every rank usually raises the
    same error, so only the first process of the job (global rank 0, or a process that knows no rank yet) prints."""
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as err:
            if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0":
                print(f"error: {err}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)
    return wrapper
