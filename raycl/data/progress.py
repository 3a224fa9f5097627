"""A progress line for long data work (decoding a dataset's images): count, images/s and ETA.

On a terminal the line is rewritten in place (carriage return); elsewhere, a Ray worker's log
file for instance, a new line is written every ``LOG_INTERVAL`` seconds so the log stays short
and still shows that the work moves. The last line gives the total time and rate.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

TTY_INTERVAL = 0.25  # seconds between rewrites of the line on a terminal
LOG_INTERVAL = 10.0  # seconds between lines in a log


class Progress:
    """Counts finished items and shows the rate and the time left.

    Args:
        what: what is being done, the line's first words (e.g. "decoding folder-1a2b").
        total: items to do.
        stream: where the lines go (default: stderr).
        interval: seconds between lines; None: :data:`TTY_INTERVAL` on a terminal, else
            :data:`LOG_INTERVAL`.
    """

    def __init__(self, what: str, total: int, stream: TextIO | None = None,
                 interval: float | None = None) -> None:
        self.what, self.total, self.done = what, total, 0
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.interval = interval if interval is not None else (
            TTY_INTERVAL if self.tty else LOG_INTERVAL)
        self.started = self.shown = time.monotonic()

    def update(self, count: int) -> None:
        """``count`` more items are done; show the line when the interval has passed."""
        self.done += count
        now = time.monotonic()
        if now - self.shown >= self.interval:
            self.shown = now
            self._write(self.line(now))

    def line(self, now: float) -> str:
        """The progress line at time ``now`` (``time.monotonic()``)."""
        elapsed = max(now - self.started, 1e-9)
        rate = self.done / elapsed
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = f"{left:.0f} s" if left != float("inf") else "?"
        return (f"{self.what}: {self.done}/{self.total} images, {rate:.0f} images/s, "
                f"ETA {eta}")

    def close(self) -> None:
        """Write the final line: how many, how long, how fast."""
        elapsed = max(time.monotonic() - self.started, 1e-9)
        self._write(f"{self.what}: {self.done} images in {elapsed:.1f} s, "
                    f"{self.done / elapsed:.0f} images/s", final=True)

    def _write(self, text: str, final: bool = False) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
