"""How a worker says that a trial failed: report keys that the driver side reads.

The trial (:mod:`raycl.pipeline`), the searcher, the MLflow callback and the sweep's summary all
read these keys, so they live in a module that imports nothing else of raycl.
"""

from __future__ import annotations

# Reported (rank 0) as 1.0 when the trial ended without a result of its own making, e.g. its loss
# diverged; MLflow records the run as FAILED and the searcher skips the trial's objective.
FAILED_KEY = "raycl/failed"
# The one-line reason that goes with FAILED_KEY (the MLflow tag ``raycl.error``).
FAIL_REASON_KEY = "raycl/fail_reason"


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite: the trial's hyperparameters diverge (a result, not an
    infrastructure failure, so it is reported and not retried)."""


__all__ = ["FAILED_KEY", "FAIL_REASON_KEY", "NonFiniteLossError"]
