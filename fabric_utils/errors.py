"""User-facing errors: one line that says what to change, printed once, no traceback, a non-zero exit."""

import functools
import json
import os
import signal
import sys
import time

RANK_ZERO_REPORTS_WITHIN_S = 10  # what a loaded machine can put between two ranks reaching the same check


class PeerLost(Exception):
    """A collective failed because another process of the job ended."""


class UserError(Exception):
    """Bad input, printed by rank 0, or by ``rank`` where only that rank can see it."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def exit_on_user_error(main):
    """A ``UserError`` becomes ``error: <message>`` on stderr and exit status 2; a lost peer, one line from rank 0."""
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as err:
            line = f"error (rank {err.rank}): {err}" if err.rank else f"error: {err}"
            under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
            if err.rank is None and _global_rank() != 0 and under_torchrun:
                # torchrun stops every worker once one exits: rank 0 (maybe on another node) gets time to report first
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                time.sleep(RANK_ZERO_REPORTS_WITHIN_S)
            if err.rank is not None or _global_rank() == 0 or under_torchrun:
                print(line, file=sys.stderr, flush=True)
            if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
                # torchrun's root cause; ErrorHandler.record_exception would put the traceback there, not the line
                record = {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}
                with open(error_file, "w") as file:
                    json.dump({"message": record}, file)
            sys.exit(2)  # as argparse exits on a bad flag
        except Exception as err:
            if not isinstance(err, PeerLost) and not lost_a_peer(err):
                raise
            if _global_rank() == 0:
                print(f"stopping: {err if isinstance(err, PeerLost) else 'another process of this job ended'}",
                      file=sys.stderr, flush=True)
            sys.exit(1)
    return wrapper


def lost_a_peer(err: Exception) -> bool:
    import torch.distributed as dist  # here: the flags are parsed, and may fail, before torch is imported
    return isinstance(err, dist.DistError) or isinstance(err, RuntimeError) and "by peer" in str(err)


def _global_rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
