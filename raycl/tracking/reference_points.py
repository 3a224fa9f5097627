"""What a leaderboard is read against, so that it does not mislead: chance, an untrained
backbone, the val split's resolution, and the winner at the epoch a stopped trial reached.

- chance: the majority class's share of each attribute on the val rows scored
  (``data/chance/<attribute>``, reported by every evaluation of a trial:
  :func:`raycl.worker.evaluate.val_reference_metrics`); ``mean`` is the attributes' mean, what
  ``val/linear/mean`` is read against;
- the baseline: the sweep's backbone before any training, scored by the same val probes
  (``baseline/val/...``, ``eval.baseline``), the leaderboard's "at init" row: on the sweep's
  parent run (:mod:`raycl.sweep.baseline`, once per sweep), else (sweeps of an older raycl) on a
  trial run;
- the resolution: two binomial standard errors at the best accuracy on ``data/val_size``
  images (:func:`noise_level`);
- a trial the scheduler (ASHA) stopped: the winner's objective at the epoch it reached, from
  MLflow's history of the objective (:func:`same_epoch_statuses`).

Read by :mod:`raycl.tracking.trial_table` (the table, the terminal and the parent run's
description).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from raycl.config.metric_names import (
    BASELINE_PREFIX,
    DATA,
    KNN,
    LINEAR,
    LINEAR_SGD,
    MEAN,
    RETRIEVAL,
    SCORED_SPLITS,
    maybe_metric,
    metric_name,
)
from raycl.tracking.runs import ENDED_TAG, STOPPED_AT_METRIC

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

# Reported by the worker's evaluations (raycl.worker.evaluate): the majority class's share of
# each attribute on the val rows scored, their number, and (eval.baseline) the same probes on
# the freshly initialised backbone before any training, each metric under this prefix.
CHANCE_PREFIX = metric_name(DATA, "chance", "x")[:-1]  # "data/chance/"
VAL_SIZE_METRIC = metric_name(DATA, None, "val_size")
# The parent run's tag naming the searched model.* keys at the base values the baseline scored
# (raycl.sweep.baseline): trials of other values started from another network.
BASELINE_SCOPE_TAG = "raycl.baseline_scope"

# Families whose score is a classifier's accuracy: what chance is the floor of.
CLASSIFIERS: tuple[str, ...] = (LINEAR, KNN, LINEAR_SGD)


def honesty(runs: list[Run], parent: Run | None = None
            ) -> tuple[dict[str, float], int | None, dict[str, float]]:
    """What a leaderboard is read against: chance per attribute (majority-class share on val;
    ``mean`` the attributes' mean, as ``val/linear/mean`` is), the number of val images scored,
    and the random-init baseline (metric name -> value, prefix removed). The parent run's first
    (the sweep's baseline task logs all three there), then the trials' own reports (a sweep of
    an older raycl: its trials scored the baseline each); every trial of a sweep scores the
    same val rows, so the first that reported one serves.

    Args:
        runs: the sweep's trial runs.
        parent: the sweep's parent run (None: the trials' alone).

    Returns:
        ``(chance, val_size, baseline)``; empty or None where no run reported it.
    """
    chance: dict[str, float] = {}
    val_size: int | None = None
    baseline: dict[str, float] = {}
    for run in [parent, *runs] if parent is not None else runs:
        metrics = run.data.metrics
        if not chance:
            chance = {key[len(CHANCE_PREFIX):]: value for key, value in metrics.items()
                      if key.startswith(CHANCE_PREFIX)}
        if val_size is None and VAL_SIZE_METRIC in metrics:
            val_size = int(metrics[VAL_SIZE_METRIC])
        if not baseline:
            baseline = {key[len(BASELINE_PREFIX):]: value for key, value in metrics.items()
                        if key.startswith(BASELINE_PREFIX)}
    if chance:
        chance[MEAN] = sum(chance.values()) / len(chance)
    return chance, val_size, baseline


def retrieval_attribute(runs: list[Run], parent: Run | None = None) -> str | None:
    """The attribute image retrieval scores (``val/retrieval/*``, ``test/retrieval/*``): its
    dataset's first (:func:`raycl.eval.scoring.evaluate_features`), from the ``data.dataset``
    param every trial logs (else the parent run's). None when no run names a labelled
    dataset; ``first attribute`` when the trials' datasets differ in it."""
    from raycl.data.registry import ATTRIBUTES  # the registry alone: no reader, no torch

    firsts = set()
    for run in [*runs, parent] if parent is not None else runs:
        attributes = ATTRIBUTES.get(run.data.params.get("data.dataset", ""), ())
        if attributes:
            firsts.add(attributes[0])
    return None if not firsts else firsts.pop() if len(firsts) == 1 else "first attribute"


def retrieval_labels(header: list[str], runs: list[Run], parent: Run | None = None
                     ) -> list[str]:
    """``header`` with the attribute each image-retrieval column scores after its name
    (``val/retrieval/rank1 (shape)``, :func:`retrieval_attribute`): the metric's name does not
    say it, and a reader would take it for every attribute's mean."""
    scored = [bool(name and name.family == RETRIEVAL and name.split in SCORED_SPLITS)
              for name in map(maybe_metric, header)]
    attribute = retrieval_attribute(runs, parent) if any(scored) else None
    if attribute is None:
        return list(header)
    return [f"{text} ({attribute})" if retrieval else text
            for text, retrieval in zip(header, scored, strict=True)]


def chance_line(chance: dict[str, float]) -> str | None:
    """One line naming chance (the majority class's share of val) per attribute, and the mean
    that ``<split>/linear/mean`` is read against; None when no trial reported it.

    Args:
        chance: :func:`honesty`'s chance per attribute (and ``mean``).
    """
    if not chance:
        return None
    parts = [f"{name} {value:.3g}" for name, value in sorted(chance.items()) if name != MEAN]
    return (f"chance (majority class on val): {', '.join(parts)}; mean {chance[MEAN]:.3g}"
            f" — a probe's accuracy at or below it learned nothing")


def chance_of(metric: str, chance: dict[str, float]) -> float | None:
    """Chance for ``metric`` when it is a classifier's accuracy on val or test (a linear probe,
    kNN, the SGD protocol: ``val/linear/shape`` -> chance of ``shape``, ``.../mean`` -> their
    mean); None for other metrics (retrieval, a loss) or without a reported chance."""
    name = maybe_metric(metric)
    if name is None or name.split not in SCORED_SPLITS or name.family not in CLASSIFIERS:
        return None
    return chance.get(name.name)


def noise_level(accuracy: float, count: int) -> float:
    """Two binomial standard errors of an accuracy measured on ``count`` images: differences
    smaller than this are within the split's sampling noise (about a 95 % band).

    Args:
        accuracy: the measured share correct, in [0, 1].
        count: images scored (> 0).

    Returns:
        ``2·sqrt(p(1-p)/n)``.

    Raises:
        ValueError: ``accuracy`` outside [0, 1] or ``count`` < 1.
    """
    if not 0.0 <= accuracy <= 1.0:
        raise ValueError(f"accuracy must be in [0, 1], got {accuracy}")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    return 2.0 * math.sqrt(accuracy * (1.0 - accuracy) / count)


def resolution_line(metric: str, best: float | None, val_size: int | None) -> str | None:
    """How large a difference the val split can resolve, at the best trial's objective
    (:func:`noise_level`).

    Args:
        metric: the objective's name.
        best: the best trial's objective (None: no trial reported it).
        val_size: the val images scored (None: not reported).

    Returns:
        The line; None without the val size or a best accuracy in [0, 1] (a loss objective is
        no share).
    """
    if val_size is None or val_size < 1 or best is None or not 0.0 <= best <= 1.0:
        return None
    noise = noise_level(best, val_size)
    return (f"val has {val_size} images: differences in {metric} under "
            f"{noise:.2g} are within noise (2 binomial standard errors at {best:.3g})")


def baseline_row(header: list[str], searched: list[str],
                 baseline: dict[str, float]) -> list[Any] | None:
    """The untrained backbone's row in a trial table's layout.

    Args:
        header: the table's columns (trial, trial_id, status, then metrics and searched keys).
        searched: the searched keys (blank in this row: it has no searched values).
        baseline: :func:`honesty`'s baseline metrics.

    Returns:
        The row (trial ``at init``, status ``baseline``), None without a baseline.
    """
    if not baseline:
        return None
    return ["at init", "", "baseline",
            *[None if key in searched else baseline.get(key) for key in header[3:]]]


def baseline_scope_line(scope: str | None) -> str | None:
    """The line saying whose network the "at init" row is when the sweep searches keys that
    change it: the base configuration's (``raycl.baseline_scope``, e.g. ``model.width=32``).

    Args:
        scope: the parent run's tag (None or empty: no ``model.*`` key searched).

    Returns:
        The line, or None.
    """
    if not scope:
        return None
    return (f"at init: the base configuration's backbone ({scope}), untrained; those keys are "
            f"searched, so a trial of other values started from another network")


def value_at_step(history: list[tuple[int, float]], step: int) -> float | None:
    """A metric's value at ``step`` from its history (``(step, value)`` pairs): the last one
    logged at or before it (evaluations may skip epochs), None when none was.

    Args:
        history: the metric's logged ``(step, value)`` pairs, any order.
        step: the step (a trial's global epoch) to read at.

    Returns:
        The value, or None.
    """
    earlier = [(at, value) for at, value in history if at <= step and math.isfinite(value)]
    return max(earlier)[1] if earlier else None


def stopped_note(epoch: int, winner_value: float | None) -> str:
    """The status of a trial the scheduler stopped: the epoch it reached and the winner's
    objective at that same epoch (``stopped at 2 (winner at 2: 0.71)``)."""
    if winner_value is None:
        return f"stopped at {epoch}"
    return f"stopped at {epoch} (winner at {epoch}: {winner_value:.4g})"


def same_epoch_statuses(client: MlflowClient, runs: list[Run], metric: str,
                        winner: Run | None) -> dict[str, str]:
    """For each trial the scheduler stopped, :func:`stopped_note` by run id, from MLflow's
    history of the objective: comparing a trial stopped at epoch 2 with a winner's epoch 8
    would mislead (the winner had four times the training).

    Args:
        client: the tracking store's client.
        runs: the sweep's trial runs.
        metric: the objective.
        winner: the best trial's run (None: no trial reported the objective).

    Returns:
        Run id -> status text, for the stopped trials only.
    """
    stopped = [run for run in runs if run.data.tags.get(ENDED_TAG) == "stopped_by_scheduler"]
    if not stopped or winner is None:
        return {}
    history = [(entry.step, entry.value)
               for entry in client.get_metric_history(winner.info.run_id, metric)]
    notes = {}
    for run in stopped:
        epoch = run.data.metrics.get(STOPPED_AT_METRIC)
        if epoch is None:  # the last epoch it reported the objective at
            steps = [entry.step for entry in client.get_metric_history(run.info.run_id,
                                                                       metric)]
            epoch = max(steps, default=None)
        if epoch is None:
            continue
        notes[run.info.run_id] = stopped_note(int(epoch), value_at_step(history, int(epoch)))
    return notes


__all__ = ["BASELINE_SCOPE_TAG", "CHANCE_PREFIX", "CLASSIFIERS", "VAL_SIZE_METRIC",
           "baseline_row", "baseline_scope_line", "chance_line",
           "chance_of", "honesty",
           "noise_level", "resolution_line", "retrieval_attribute", "retrieval_labels",
           "same_epoch_statuses", "stopped_note",
           "value_at_step"]
