"""How a trial says how it ended: report keys that the driver side reads, and how they read.

The worker and the trial (:mod:`raycl.trial.trainable`) report these keys; the searcher, the MLflow
callback and the progress display read them, so they live in a module that imports nothing
else of raycl.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

# Reported (rank 0) as 1.0 when the trial ended without a result of its own making, e.g. its loss
# diverged; MLflow records the run as FAILED and the searcher skips the trial's objective.
FAILED_KEY = "raycl/failed"
# The one-line reason that goes with FAILED_KEY (the MLflow tag ``raycl.error``).
FAIL_REASON_KEY = "raycl/fail_reason"
# Reported by the trial process as 1.0 when the trial cannot train (MCL's K^N > M/b) and was
# pruned before any training, with the reason.
SKIPPED_KEY = "raycl/skipped"
SKIP_REASON_KEY = "raycl/skip_reason"

Ending = Literal["skipped", "diverged", "collapsed", "completed", "stopped_by_scheduler"]


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite: the trial's hyperparameters diverge (a result, not an
    infrastructure failure, so it is reported and not retried)."""


def trial_ending(last: Mapping[str, Any], num_stages: int, epochs: int,
                 collapsed: bool = False) -> Ending:
    """How a trial Tune calls complete ended, from its last report: pruned before training,
    diverged, collapsed (stopped by ``tune.collapse``), ran to its end (the last epoch of its
    last stage's training phase), or stopped by the scheduler (Tune marks a trial ASHA stopped
    as done too).

    Args:
        last: the trial's last report.
        num_stages: the trial's stages (``config.num_stages``).
        epochs: the training epochs of a stage (``train.epochs``).
        collapsed: ``tune.collapse`` calls the last report collapsed
            (:meth:`raycl.config.collapse.CollapseConfig.reason`).
    """
    if last.get(SKIPPED_KEY):
        return "skipped"
    if last.get(FAILED_KEY):
        return "diverged"
    if collapsed:
        return "collapsed"
    if (last.get("stage", 0) == num_stages - 1 and last.get("phase", "train") == "train"
            and last.get("epoch") == epochs):
        return "completed"
    return "stopped_by_scheduler"


__all__ = ["FAILED_KEY", "FAIL_REASON_KEY", "SKIPPED_KEY", "SKIP_REASON_KEY", "Ending",
           "NonFiniteLossError", "trial_ending"]
