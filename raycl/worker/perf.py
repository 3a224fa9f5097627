"""The ``perf/*`` figures a worker measures about itself: start-up, between-stage time, memory."""

from __future__ import annotations

import resource
import sys
import time

from raycl.worker.device_hours import device_hours


class Clock:
    """Start-up (trial start to this process's first optimizer step) and between-stage times.

    Each figure is measured once and goes out with the next report (:meth:`pop_metrics`).
    """

    def __init__(self, trial_started_at: float | None) -> None:
        self.trial_started_at = trial_started_at or time.time()
        self.stepped = False
        # Measured but not reported yet: each figure goes out once, with the next report.
        self.pending: dict[str, float] = {}
        # perf/device_hours a resumed trial had reported (raycl.worker.device_hours).
        self.device_hours_before = 0.0

    def first_step_done(self) -> None:
        """Called after every optimizer step; the first one fixes ``perf/startup_seconds``."""
        if not self.stepped:
            self.stepped = True
            self.pending["perf/startup_seconds"] = time.time() - self.trial_started_at

    def record(self, name: str, seconds: float) -> None:
        """Keep ``name`` (e.g. ``perf/kmeans_seconds``) for the next report."""
        self.pending[name] = seconds

    def device_hours(self, devices: float) -> float:
        """``perf/device_hours`` now: since the trial (or its resumption) started, on
        ``devices``, plus what a resumed trial had reported (:mod:`raycl.worker.device_hours`)."""
        return device_hours(time.time() - self.trial_started_at, devices,
                            self.device_hours_before)

    def pop_metrics(self) -> dict[str, float]:
        """The figures measured since the last report, handed out once."""
        metrics, self.pending = self.pending, {}
        return metrics


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


__all__ = ["Clock", "peak_rss_mb"]
