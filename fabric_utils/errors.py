"""User-facing errors: one line that says what to change, printed once, no traceback, a non-zero exit."""

import functools
import json
import os
import sys
import time

EXIT_USER_ERROR = 2
EXIT_PEER_FAILED = 1


class PeerLost(Exception):
    """A collective failed because another process of the job ended; the message says what is known of it."""


class UserError(Exception):
    """Bad input from the user (flags, data, model, checkpoint, output folder). Most are found alike on every rank and
    printed by rank 0 alone; one that only its own rank can see (a file of its own) names that ``rank``."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def exit_on_user_error(main):
    """Turns a ``UserError`` into ``error: <message>`` on stderr and exit status 2: printed by the first process of
    the job (global rank 0, or a process that knows no rank yet), or by the rank the error names. The other ranks of
    a job that lost a process stop without a traceback of their own: their next collective fails (gloo: "Connection
    closed by peer"; NCCL: a DistError), and rank 0 says so in one line (``PeerLost``: with what it knows)."""
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as err:
            where = f" (rank {err.rank})" if err.rank else ""
            if err.rank is not None or _global_rank() == 0:
                print(f"error{where}: {err}", file=sys.stderr, flush=True)
            tell_torchrun(f"error{where}: {err}")
            sys.exit(EXIT_USER_ERROR)
        except Exception as err:
            if not isinstance(err, PeerLost) and not lost_a_peer(err):
                raise
            if _global_rank() == 0:
                print(f"stopping: {err if isinstance(err, PeerLost) else 'another process of this job ended'}",
                      file=sys.stderr, flush=True)
            sys.exit(EXIT_PEER_FAILED)
    return wrapper


def tell_torchrun(line: str) -> None:
    """Under torchrun (and ``fabric run``, which runs it) a failed process's error file is what its failure report
    shows as the cause, in place of a hint to enable tracebacks."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        record = {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}
        with open(error_file, "w") as file:
            json.dump({"message": record}, file)


def lost_a_peer(err: Exception) -> bool:
    """Whether a collective failed because another process of the job is gone."""
    import torch.distributed as dist  # here: the flags are parsed, and may fail, before torch is imported
    return isinstance(err, dist.DistError) or isinstance(err, RuntimeError) and "by peer" in str(err)


def _global_rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
