"""The Pareto front of a multi-objective sweep on its MLflow runs (:mod:`raycl.tracking.pareto`).

After every trial the callback (:class:`raycl.tracking.callback.MLflowSweepCallback`) calls
:func:`log_pareto`: ``pareto.csv`` and ``pareto.png`` on the parent run, the tag
``raycl.objectives`` there, and ``raycl.pareto`` (true/false) on each trial's run, which the
MLflow UI can filter on (``tags.raycl.pareto = 'true'``). A failure is logged, never raised: the
front is never worth a sweep.
"""

from __future__ import annotations

import csv
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from raycl.tracking.pareto import (
    OBJECTIVES_TAG,
    PARETO_TAG,
    front_run_ids,
    objectives_tag,
    scored_runs,
)
from raycl.tracking.runs import SEARCHED_TAG, TRIAL_TAG
from raycl.tracking.trial_table import searched_values

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

    from raycl.config.schema import CoreConfig

logger = logging.getLogger(__name__)


def write_pareto_csv(path: Path, scored: Sequence[tuple[Run, list[float]]], front: set[str],
                     objectives: Sequence[tuple[str, str]]) -> None:
    """``pareto.csv``: every trial that may be ranked and reported all objectives
    (:func:`~raycl.tracking.pareto.scored_runs`), the front's first, with
    ``on_front`` (1/0), its name, trial id, objectives and searched values."""
    searched = sorted({key for run, _ in scored
                       for key in searched_values(run.data.tags.get(SEARCHED_TAG, ""))})
    ordered = sorted(scored, key=lambda item: item[0].info.run_id not in front)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["on_front", "trial", "trial_id", *[m for m, _ in objectives],
                         *searched])
        for run, values in ordered:
            params = searched_values(run.data.tags.get(SEARCHED_TAG, ""))
            writer.writerow([int(run.info.run_id in front), run.info.run_name or "",
                             run.data.tags.get(TRIAL_TAG, ""), *values,
                             *[params.get(key, "") for key in searched]])


def plot_pareto(path: Path, scored: Sequence[tuple[Run, list[float]]], front: set[str],
                objectives: Sequence[tuple[str, str]]) -> None:
    """``pareto.png``: the first two objectives, every trial a point, the front joined and
    labelled by trial (with more objectives, a point on the front may look dominated here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (x_metric, x_mode), (y_metric, y_mode) = objectives[0], objectives[1]
    figure, axes = plt.subplots(figsize=(6, 4.5))
    rest = [values for run, values in scored if run.info.run_id not in front]
    on = sorted(((values, run) for run, values in scored if run.info.run_id in front),
                key=lambda item: item[0][0])
    if rest:
        axes.scatter([v[0] for v in rest], [v[1] for v in rest], color="0.6", label="dominated")
    axes.plot([v[0] for v, _ in on], [v[1] for v, _ in on], "o-", color="C3",
              label="Pareto front")
    for values, run in on:
        axes.annotate((run.info.run_name or "").split(" ")[0], (values[0], values[1]),
                      textcoords="offset points", xytext=(4, 4), fontsize=8)
    axes.set_xlabel(f"{x_metric} ({x_mode})")
    axes.set_ylabel(f"{y_metric} ({y_mode})")
    more = f" (first 2 of {len(objectives)} objectives)" if len(objectives) > 2 else ""
    axes.set_title(f"Pareto front{more}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def pareto_markdown(scored: Sequence[tuple[Run, list[float]]], front: set[str],
                    objectives: Sequence[tuple[str, str]]) -> str:
    """The front as a section of the parent run's description: what it is, how many trials are
    on it and where the rest is, then its trials (by the first objective, best first).

    Args:
        scored: every trial that may be ranked and reported all objectives, with their
            values.
        front: the run ids on the Pareto front.
        objectives: ``(metric, mode)`` pairs, in the order of ``tune.objectives``.

    Returns:
        Markdown, starting with a blank line (appended to the leaderboard's description).
    """
    names = ", ".join(f"`{metric}` ({mode})" for metric, mode in objectives)
    on = [(run, values) for run, values in scored if run.info.run_id in front]
    on.sort(key=lambda item: item[1][0], reverse=objectives[0][1] == "max")
    lines = ["", "", f"**Pareto front** of {names}: {len(on)} of {len(scored)} trial(s) that "
             f"finished and reported every objective (no other trial is as good on all of them "
             f"and better on one; a failed, killed or running trial is never on it). Every "
             f"such trial: artifact `pareto.csv`, the plot `pareto.png`; its trials in the runs "
             f"list: `tags.{PARETO_TAG} = 'true'`.", "",
             "| trial | " + " | ".join(f"`{metric}`" for metric, _ in objectives) + " |",
             "|---" * (len(objectives) + 1) + "|"]
    for run, values in on:
        name = (run.info.run_name or run.info.run_id).replace("|", "\\|")
        lines.append(f"| {name} | " + " | ".join(f"{value:.4g}" for value in values) + " |")
    return "\n".join(lines)


def log_pareto(client: MlflowClient, parent_run_id: str, children: Sequence[Run],
               config: CoreConfig) -> str:
    """The front of ``children`` on the parent run (``pareto.csv``, ``pareto.png``, the tag
    ``raycl.objectives``) and on each trial's run (``raycl.pareto``); nothing for a sweep
    without ``tune.objectives``. Never raises (logs why).

    Returns:
        The front's section of the parent run's description (:func:`pareto_markdown`), or ""
        (no objectives, no trial scored yet, or a failure).
    """
    if not config.tune.objectives:
        return ""
    try:
        objectives = [(o.metric, o.mode) for o in config.tune.objectives]
        client.set_tag(parent_run_id, OBJECTIVES_TAG, objectives_tag(objectives))
        scored = scored_runs(children, [metric for metric, _ in objectives])
        front = front_run_ids(children, objectives)
        for run in children:
            on = "true" if run.info.run_id in front else "false"
            if run.data.tags.get(PARETO_TAG) != on:
                client.set_tag(run.info.run_id, PARETO_TAG, on)
        if not scored:
            return ""
        with tempfile.TemporaryDirectory() as directory:
            csv_path, png_path = Path(directory, "pareto.csv"), Path(directory, "pareto.png")
            write_pareto_csv(csv_path, scored, front, objectives)
            plot_pareto(png_path, scored, front, objectives)
            client.log_artifact(parent_run_id, str(csv_path))
            client.log_artifact(parent_run_id, str(png_path))
        return pareto_markdown(scored, front, objectives)
    except Exception:  # the front is never worth a sweep
        logger.warning("could not write the Pareto front to the parent run", exc_info=True)
        return ""


__all__ = ["log_pareto", "pareto_markdown", "plot_pareto", "write_pareto_csv"]
