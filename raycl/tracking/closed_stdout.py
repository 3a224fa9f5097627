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


__all__ = ["CLOSED_EXIT_CODE", "stdout_closed"]
