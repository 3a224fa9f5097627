"""How far each rung of a sweep can be trusted: ``rung_agreement.csv`` on the parent run.

SSL rankings can reverse late (a method that warms up slowly ends on top), so an ASHA rung at a
quarter of the budget may stop the eventual winner. Once every trial of a sweep has ended, this
reads, over the trials that ran to their last epoch, each per-epoch figure's history (the
objective, the label-free figures, the online probe's mean, ``train/loss``) and says for every
evaluated epoch how well the ranking by that figure at that epoch agreed with the ranking by the
final objective: Kendall's τ and the share of the final top 3 already in the figure's top 3
(``rung_agreement.csv``, and ``rung_agreement.png``: τ against the epoch, one line per figure).
The leaderboard's description gets one line: from which epoch on the objective's ranking agreed
(τ ≥ 0.8).

Pure functions of the histories (:func:`agreement_rows`, :func:`settled_epoch`) and the MLflow
side (:func:`log_rung_agreement`); failures are the caller's to log, never a sweep's end.
"""

from __future__ import annotations

import csv
import logging
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from mlflow import MlflowClient
from mlflow.entities import Run

from raycl.config.metric_names import LABEL_FREE, MEAN, ONLINE_LINEAR, VAL, metric_name
from raycl.config.schema import CoreConfig
from raycl.tracking.runs import COMPLETED, ENDED_TAG

if TYPE_CHECKING:
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)

# The agreement a rung needs for its verdicts to count as settled.
SETTLED_TAU = 0.8
# Fewer trials than this at the last epoch: no ranking to agree with.
MIN_TRIALS = 3
TOP = 3
# Figures besides the objective, and which way is better for a top-3 (alpha: near 1).
FIGURES: dict[str, str] = {
    metric_name(VAL, LABEL_FREE, "rankme"): "max",
    metric_name(VAL, LABEL_FREE, "std"): "max",
    metric_name(VAL, LABEL_FREE, "alpha"): "near_one",
    metric_name(VAL, ONLINE_LINEAR, MEAN): "max",
    "train/loss": "min",
}
COLUMNS = ("figure", "epoch", "trials", "kendall_tau", "top3_overlap")
# The parent run's tag with the description's line, which raycl.leaderboard prints too.
RUNG_AGREEMENT_TAG = "raycl.rung_agreement"

# run id -> epoch -> value
History = dict[str, dict[int, float]]


def _goodness(values: np.ndarray, direction: str) -> np.ndarray:
    """Higher is better, whatever the figure."""
    if direction == "min":
        return -values
    if direction == "near_one":
        return -np.abs(values - 1.0)
    return values


def agreement_rows(histories: Mapping[str, History], final: Mapping[str, float],
                   directions: Mapping[str, str], final_mode: str) -> list[dict[str, object]]:
    """One row per (figure, epoch): over the runs in ``final`` that have the figure at that
    epoch, Kendall's τ between the figure and the final objective (each turned so that higher is
    better: τ = 1 means the same order) and the top-3 overlap.

    Args:
        histories: figure -> run id -> epoch -> value.
        final: run id -> final objective (the runs that reached their last epoch).
        directions: figure -> "max", "min" or "near_one".
        final_mode: the objective's mode ("max" or "min").

    Returns:
        Rows with :data:`COLUMNS`; none for an epoch with fewer than :data:`MIN_TRIALS` runs.
    """
    from scipy.stats import kendalltau

    rows: list[dict[str, object]] = []
    for figure, runs in histories.items():
        epochs = sorted({epoch for run_id in final for epoch in runs.get(run_id, {})})
        for epoch in epochs:
            ids = [run_id for run_id in final if epoch in runs.get(run_id, {})]
            if len(ids) < MIN_TRIALS:
                continue
            at = _goodness(np.array([runs[run_id][epoch] for run_id in ids]),
                           directions[figure])
            end = _goodness(np.array([final[run_id] for run_id in ids]), final_mode)
            tau = kendalltau(at, end).statistic
            top = min(TOP, len(ids))
            overlap = len(set(np.argsort(-at)[:top]) & set(np.argsort(-end)[:top])) / top
            rows.append({"figure": figure, "epoch": epoch, "trials": len(ids),
                         "kendall_tau": float(tau) if np.isfinite(tau) else float("nan"),
                         "top3_overlap": overlap})
    return rows


def settled_epoch(rows: Sequence[Mapping[str, object]], figure: str) -> int | None:
    """The first epoch from which ``figure``'s τ stays at or above :data:`SETTLED_TAU` (None:
    never, or no rows)."""
    taus = sorted((int(row["epoch"]), float(row["kendall_tau"]))  # type: ignore[arg-type]
                  for row in rows if row["figure"] == figure)
    settled = None
    for epoch, tau in reversed(taus):
        if not tau >= SETTLED_TAU:
            break
        settled = epoch
    return settled


def agreement_figure(rows: Sequence[Mapping[str, object]], objective: str) -> Figure:
    """Kendall's τ with the final ranking against the epoch, one line per figure of ``rows``
    (NaN, a tie, leaves a gap), the objective's drawn thickest, and the :data:`SETTLED_TAU`
    line. A bare Figure (Agg, no pyplot), as the leaderboard's plot."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4.0))
    axes = figure.add_subplot()
    for name in dict.fromkeys(str(row["figure"]) for row in rows):
        points = sorted((int(row["epoch"]), float(row["kendall_tau"]))  # type: ignore[arg-type]
                        for row in rows if row["figure"] == name)
        axes.plot([epoch for epoch, _ in points], [tau for _, tau in points], marker="o",
                  label=name, linewidth=2.5 if name == objective else 1.2)
    axes.axhline(SETTLED_TAU, color="grey", linestyle="--", linewidth=0.8)
    axes.set(xlabel="epoch", ylabel="Kendall τ with the final ranking", ylim=(-1.05, 1.05),
             title="How early each figure ranked the trials as they ended")
    axes.legend(fontsize="small", loc="lower right")
    figure.tight_layout()
    return figure


def _histories(client: MlflowClient, runs: Sequence[Run],
               figures: Sequence[str]) -> dict[str, History]:
    return {figure: {run.info.run_id: {int(m.step): float(m.value) for m in
                                       client.get_metric_history(run.info.run_id, figure)}
                     for run in runs}
            for figure in figures}


def log_rung_agreement(client: MlflowClient, parent_run_id: str, children: Sequence[Run],
                       config: CoreConfig) -> str:
    """``rung_agreement.csv`` on the parent run once no trial runs any more and at least
    :data:`MIN_TRIALS` ran to their end; the description's line ("" when not written)."""
    if config.tune.objectives or any(run.info.status == "RUNNING" for run in children):
        return ""
    metric, mode = config.tune.metric, config.tune.mode
    ended = [run for run in children if run.info.status == "FINISHED"
             and run.data.tags.get(ENDED_TAG, COMPLETED) == COMPLETED
             and metric in run.data.metrics]
    if len(ended) < MIN_TRIALS:
        return ""
    directions = {metric: mode, **{name: way for name, way in FIGURES.items() if name != metric}}
    final = {run.info.run_id: run.data.metrics[metric] for run in ended}
    rows = agreement_rows(_histories(client, ended, list(directions)), final, directions, mode)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory, "rung_agreement.csv")
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        client.log_artifact(parent_run_id, str(path))
        if rows:
            plot = Path(directory, "rung_agreement.png")
            agreement_figure(rows, metric).savefig(plot, dpi=100)
            client.log_artifact(parent_run_id, str(plot))
    line = _settled_line(rows, metric, len(ended))
    client.set_tag(parent_run_id, RUNG_AGREEMENT_TAG, line)
    return f"\n\n{line}"


def _settled_line(rows: Sequence[Mapping[str, object]], metric: str, trials: int) -> str:
    """One sentence: from which epoch the ranking by ``metric`` agreed with the final one."""
    epoch = settled_epoch(rows, metric)
    last = max((int(row["epoch"]) for row in rows if row["figure"] == metric), default=None)
    if epoch is None or last is None:
        return (f"Rankings by {metric} never agreed with the final one (τ ≥ {SETTLED_TAU}) "
                f"before the end: see rung_agreement.csv.")
    return (f"The ranking by {metric} agreed with the final one (Kendall τ ≥ {SETTLED_TAU}) "
            f"from epoch {epoch} of {last} on, over {trials} trials: an ASHA grace period "
            f"shorter than that judged before the ranking settled (rung_agreement.csv).")


__all__ = ["COLUMNS", "FIGURES", "RUNG_AGREEMENT_TAG", "SETTLED_TAU", "agreement_figure",
           "agreement_rows", "log_rung_agreement", "settled_epoch"]
