"""What the sweep's parent run gets after every trial besides the leaderboard: the Pareto front
of ``tune.objectives`` (:func:`raycl.tracking.pareto_log.log_pareto`) and the record of a warm
start's seeded configurations (:func:`log_warm_start`). Neither ever raises: the callback
(:class:`raycl.tracking.callback.MLflowSweepCallback`) calls them inside a sweep.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from raycl.sweep.warm_start import WARM_START_TAG, find_seeds, warm_start_tag
from raycl.tracking.pareto_log import log_pareto

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

    from raycl.config.schema import CoreConfig

logger = logging.getLogger(__name__)


def log_warm_start(client: MlflowClient, parent_run_id: str, config: CoreConfig) -> None:
    """The parent run's ``raycl.warm_start`` tag (the seeded configurations), once; nothing
    without ``tune.warm_start``. Never raises (logs why)."""
    if not config.tune.warm_start:
        return
    try:
        if WARM_START_TAG not in client.get_run(parent_run_id).data.tags:
            client.set_tag(parent_run_id, WARM_START_TAG,
                           warm_start_tag(config.tune.warm_start, find_seeds(config)))
    except Exception:  # a record is never worth a sweep
        logger.warning("could not record the warm start on the parent run", exc_info=True)


def log_sweep_outputs(client: MlflowClient, parent_run_id: str, children: Sequence[Run],
                      config: CoreConfig) -> str:
    """The Pareto front and the warm start's record on the parent run (each when configured),
    and once no trial runs any more how early its ranking settled
    (:mod:`raycl.tracking.rung_agreement`); what they add to its description (markdown)."""
    from raycl.tracking.rung_agreement import log_rung_agreement

    front = log_pareto(client, parent_run_id, children, config)
    log_warm_start(client, parent_run_id, config)
    try:
        return front + log_rung_agreement(client, parent_run_id, children, config)
    except Exception:  # a diagnostic is never worth the leaderboard
        logger.warning("could not write rung_agreement.csv", exc_info=True)
        return front


__all__ = ["log_sweep_outputs", "log_warm_start"]
