"""The lines of Ray's, Ray Data's and Optuna's output that a quiet sweep leaves out.

Other processes' output reaches the driver through Ray, which prints it to ``sys.stdout`` and
``sys.stderr`` (no logging filter in the driver reaches it). :func:`raycl.sweep.display.quiet_ray`
wraps both streams in :class:`DropLines` for a sweep's length; ``-v`` keeps everything.
"""

from __future__ import annotations

import re
import threading
from typing import Any

# Lines other processes print that Ray forwards to the driver's stdout and stderr (no logging
# filter here reaches them): chatter a quiet sweep leaves out, each matched on its own words.
DROPPED_LINES = re.compile("|".join((
    # Ray Data, once per epoch and split in stream mode (raycl prints the epochs).
    "\u2714\ufe0f?" r"\s*Dataset \S+ execution finished in [\d.]+ seconds",
    # Ray Data, once per trial process: raycl turns the bars off on purpose.
    r"Progress bars disabled\. To enable, set `ray\.data\.DataContext",
    # The raylet, when stream mode's decoder tasks start worker processes; names the node id.
    r"worker processes have been started on node: \S+ with address",
    # Optuna's grid sampler calls Study.stop when the grid is covered, outside an
    # optimize loop (Tune drives the study): a warning per trial that changes nothing.
    r"`Study\.stop` is supposed to be invoked inside an objective function",
)))
# The ids Ray's log format appends to every record of its processes (what is left of a
# warning is the message; the ids are in Ray's own log files).
RAY_CONTEXT = re.compile(r"(?:\s+(?:job_id|worker_id|node_id|actor_id|task_id|timestamp_ns)"
                         r"=\S+)+\s*$")


class DropLines:
    """A text stream that writes every line to ``stream`` but those ``pattern`` matches (with
    a multi-line message's following indented lines), without the ids Ray appends
    (:data:`RAY_CONTEXT`). A partial line waits for its end;
    ``flush`` writes it as it is. Everything else is the wrapped stream's."""

    def __init__(self, stream: Any, pattern: re.Pattern[str] = DROPPED_LINES) -> None:
        self.stream, self.pattern = stream, pattern
        self._partial, self._dropping = "", False
        self._lock = threading.Lock()  # Ray prints other processes' lines from its threads

    def write(self, text: str) -> int:
        with self._lock:
            *lines, self._partial = (self._partial + text).split("\n")
            for line in lines:
                continued = self._dropping and line[:1] in (" ", "\t")
                self._dropping = continued or bool(self.pattern.search(line))
                if not self._dropping:
                    self.stream.write(RAY_CONTEXT.sub("", line) + "\n")
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._partial:
                self.stream.write(self._partial)
                self._partial = ""
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


__all__ = ["DROPPED_LINES", "RAY_CONTEXT", "DropLines"]
