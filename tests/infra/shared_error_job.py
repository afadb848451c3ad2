"""Every rank raises the same UserError, rank 0 last by the seconds given (a rank slowed by a loaded machine)."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fabric_utils.errors import UserError, exit_on_user_error  # noqa: E402


@exit_on_user_error
def main():
    if os.environ["RANK"] == "0":
        time.sleep(float(sys.argv[1]))
    raise UserError("the same bad input on every rank")


if __name__ == "__main__":
    main()
