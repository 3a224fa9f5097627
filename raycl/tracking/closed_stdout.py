"""Output piped into a reader that stops early (``python -m raycl.leaderboard | head``).

Python ignores SIGPIPE, so a print after the reader has gone raises ``BrokenPipeError``, and so
does the interpreter's final flush of stdout. Python's documentation (the :mod:`signal` module,
"Note on SIGPIPE") recommends pointing stdout at ``os.devnull`` then, rather than restoring
SIGPIPE's default, which would also kill the process on any interrupted socket (Ray's and
MLflow's connections).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

# The exit code Python's documentation uses for output nobody reads any more.
CLOSED_EXIT_CODE = 1


def stdout_closed() -> None:
    """Send the rest of stdout to ``os.devnull``: later prints and the final flush succeed
    without output, and no traceback is printed."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor (a test's captured stdout): nothing to do
        pass


def reading_command(command: Callable[[], int]) -> int:
    """Run a command that reads a sweep back and prints it (``raycl.leaderboard``,
    ``raycl.compare``) and return its exit code: piped into a reader that stops early
    (``| head``), it stops quietly (:data:`CLOSED_EXIT_CODE`); a tracking store that is away is
    one ``error:`` line, exit 1."""
    from raycl.tracking.retry import TrackingUnavailableError

    try:
        code = command()
        sys.stdout.flush()  # here, not at exit: a closed pipe is caught below
    except BrokenPipeError:
        stdout_closed()
        return CLOSED_EXIT_CODE
    except TrackingUnavailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return code


__all__ = ["CLOSED_EXIT_CODE", "reading_command", "stdout_closed"]
