"""``python -m raycl.leaderboard``: a sweep's best trials from MLflow, as a table.

Trials are ranked by the sweep's objective (a validation metric); the test counterpart of the
objective and of every per-attribute probe stands beside it, reported, never used to rank. By
default the most recent sweep (parent run) of the experiment; ``--all`` ranks the trials of every
sweep in it.

The same table (:func:`trial_table`) is what the sweep's callback writes to its parent run after
every trial: ``leaderboard.csv``, ``leaderboard.png`` (:func:`plot_leaderboard`) and the run's
description (:func:`markdown_summary`).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raycl.config import Domain, key_symbol, reported_test_metric, resolve_tracking_uri
from raycl.tracking import (
    GREATER_IS_BETTER_TAG,
    LEADERBOARD_VIEW,
    PARENT_TAG,
    ROLE_TAG,
    TRIAL_INDEX_TAG,
    TRIAL_TAG,
    VIEW_TAG_PREFIX,
    _client,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from mlflow import MlflowClient
    from mlflow.entities import Run


def leaderboard_rows(
    tracking_uri: str, experiment: str, top: int = 10, all_sweeps: bool = False
) -> tuple[list[str], list[list[str]], str]:
    """Header, rows and a title line for the leaderboard (raises LookupError when empty)."""
    client = _client(resolve_tracking_uri(tracking_uri))
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise LookupError(f"no MLflow experiment named {experiment!r} at {tracking_uri}")
    parents = client.search_runs([found.experiment_id], f"tags.`{ROLE_TAG}` = 'sweep'",
                                 order_by=["attributes.start_time DESC"])
    if not parents:
        raise LookupError(f"experiment {experiment!r} has no raycl sweep")
    metric = parents[0].data.tags.get("raycl.metric", "val/linear/mean")
    mode = parents[0].data.tags.get("raycl.mode", "max")
    children = trial_runs(client, found.experiment_id,
                          None if all_sweeps else parents[0].info.run_id)
    table = trial_table(children, metric, mode)
    shown = [i for i, name in enumerate(table.header) if name != "trial_id"]
    header = ["#", *[table.header[i] for i in shown]]
    rows = [[str(rank), *[_fmt(row[i]) if i > 2 else str(row[i]) for i in shown]]
            for rank, row in enumerate(table.rows[:top], start=1)]
    title = (f"{experiment}: {len(children)} trial(s), best {top} by {metric} ({mode})"
             f"{'' if all_sweeps else ', latest sweep'}; test/, transfer/ and diag/ columns are "
             f"reported, not ranked on")
    return header, rows, title


def trial_runs(client: MlflowClient, experiment_id: str, parent_run_id: str | None) -> list[Run]:
    """The trial (child) runs of one sweep (its parent run), or of every sweep (None)."""
    filter_string = f"tags.`{ROLE_TAG}` = 'trial'"
    if parent_run_id is not None:
        filter_string += f" and tags.`{PARENT_TAG}` = '{parent_run_id}'"
    return client.search_runs([experiment_id], filter_string, max_results=5000)


@dataclass
class TrialTable:
    """Trials ranked by the objective, best first, with every column the leaderboard shows.

    ``header`` is ``trial`` (the run name), ``trial_id``, ``status`` (``raycl.ended``, or the
    run's status while it runs), the objective, its test counterpart (when it has one), each
    searched key and the reported extras; ``rows`` hold raw values (a float, or None where a
    run lacks the metric; searched values as their ``raycl.searched`` text), in ``runs``'
    order.
    """

    metric: str
    mode: str
    objective_test: str | None
    searched: list[str]
    header: list[str]
    rows: list[list[Any]]
    runs: list[Run]

    def objective(self, run: Run) -> float | None:
        """The run's (last) objective, None when it has not reported one."""
        value = run.data.metrics.get(self.metric)
        return value if value is not None and math.isfinite(value) else None


def trial_table(children: list[Run], metric: str, mode: str) -> TrialTable:
    """Rank ``children`` by ``metric`` (``mode`` max or min; trials without it last) and lay out
    the leaderboard's columns (the CLI's table and the parent run's ``leaderboard.csv``)."""

    def score(run: Run) -> float:
        value = run.data.metrics.get(metric, math.nan)
        if math.isnan(value):
            return math.inf
        return -value if mode == "max" else value

    children = sorted(children, key=score)
    searched = sorted({key for run in children
                       for key in _searched(run.data.tags.get("raycl.searched", ""))})
    objective_test = reported_test_metric(metric)
    attributes = sorted({key.split("/", 2)[2] for run in children for key in run.data.metrics
                         if key.startswith("val/linear/")})
    # Reported beside the objective, never ranked on: transfer means, the effective rank,
    # (NNCLR, All4One) the support set's NN-retrieval accuracy, image retrieval (rank-1, mAP)
    # and (CLIP) the MMVP-style pairs, zero-shot accuracy and caption retrieval.
    reported = sorted({key for run in children for key in run.data.metrics
                       if re.fullmatch(r"transfer/[^/]+/linear/mean", key)})
    reported += [key for key in ("diag/effective_rank", "val/nn_retrieval/mean",
                                 "val/retrieval/rank1", "val/retrieval/map", "val/mmvp/mean",
                                 "test/mmvp/mean", "val/zeroshot/mean", "val/i2t/r1",
                                 "val/t2i/r1")
                 if key != metric and any(key in run.data.metrics for run in children)]
    extra = [*reported, *[key for attribute in attributes
                          for key in (f"val/linear/{attribute}", f"test/linear/{attribute}")
                          if key not in (metric, objective_test)]]
    tested = [objective_test] if objective_test else []
    header = ["trial", "trial_id", "status", metric, *tested, *searched, *extra]
    rows = []
    for run in children:
        values = _searched(run.data.tags.get("raycl.searched", ""))
        rows.append([run.info.run_name or run.info.run_id[:8],
                     run.data.tags.get(TRIAL_TAG, ""),
                     run.data.tags.get("raycl.ended", run.info.status.lower()),
                     *[run.data.metrics.get(key) for key in (metric, *tested)],
                     *[values.get(key) for key in searched],
                     *[run.data.metrics.get(key) for key in extra]])
    return TrialTable(metric, mode, objective_test, searched, header, rows, children)


def write_csv(table: TrialTable, path: Path) -> None:
    """The table as CSV, best first, with a ``rank`` column; numbers at full precision, an
    empty cell where a trial lacks the metric."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["rank", *table.header])
        for rank, row in enumerate(table.rows, start=1):
            writer.writerow([rank, *["" if value is None else value for value in row]])


def markdown_summary(table: TrialTable, sweep: str, top: int = 10) -> str:
    """A short markdown description of the sweep for its parent run's page: the objective, the
    best trial so far and the top rows."""
    scored = [run for run in table.runs if table.objective(run) is not None]
    tested = f"; its test counterpart `{table.objective_test}` is reported, not ranked on" \
        if table.objective_test else ""
    lines = [f"**{sweep}**: trials ranked by `{table.metric}` ({table.mode}){tested}. "
             f"{len(scored)} of {len(table.runs)} trial(s) reported it."]
    if scored:
        best = table.rows[0]
        test_note = f", test {_fmt(best[4])}" if table.objective_test else ""
        lines.append(f"Best so far: **{_cell(best[0])}** ({_fmt(best[3])}{test_note}).")
    columns = 5 if table.objective_test else 4
    lines += ["", "| # | " + " | ".join(_cell(name) for name in table.header[:columns]
                                        if name != "trial_id") + " |",
              "|---" * (columns) + "|"]
    for rank, row in enumerate(table.rows[:top], start=1):
        cells = [row[0], row[2], *[_fmt(value) for value in row[3:columns]]]
        lines.append(f"| {rank} | " + " | ".join(_cell(cell) for cell in cells) + " |")
    lines += ["", "Every trial and column: artifact `leaderboard.csv`; the objective against "
              "each searched parameter: `leaderboard.png`."]
    return "\n".join(lines)


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def plot_leaderboard(table: TrialTable, path: Path,
                     space: Mapping[str, Domain] | None = None) -> None:
    """``leaderboard.png``: :func:`leaderboard_figure`, saved."""
    leaderboard_figure(table, space).savefig(path, dpi=100)


def leaderboard_figure(table: TrialTable, space: Mapping[str, Domain] | None = None) -> Figure:
    """One panel per searched parameter, the objective (y) against that parameter (x), one
    point per trial that reported it, the best trial highlighted. Numeric parameters on a log
    axis when searched log-uniformly or spanning more than two decades; others as categories.
    Nothing searched (seed repeats): the objective against the trial's index. ``space`` (the
    sweep's search space) orders the panels and gives each domain's kind; without it, the
    ``raycl.searched`` keys are plotted. A bare :class:`~matplotlib.figure.Figure` (Agg, no
    pyplot): the Tune driver's plotting state stays untouched and nothing needs closing."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    space = dict(space or {})
    keys = list(space) if space else [key for key in table.searched if key != "seed"]
    points = []  # (run name, {key: text value}, index, objective)
    for run in table.runs:
        value = table.objective(run)
        if value is not None:
            index = run.data.tags.get(TRIAL_INDEX_TAG, "")
            points.append((run.info.run_name or run.info.run_id[:8],
                           _searched(run.data.tags.get("raycl.searched", "")),
                           int(index) if index.isdigit() else None, value))
    best = points[0] if points else None  # table.runs is ranked: the first scored is the best
    panels = keys or ["trial index"]
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(4.2 * columns, 3.4 * rows))
    axes = figure.subplots(rows, columns, squeeze=False)
    for axis in axes.flat[len(panels):]:
        axis.set_visible(False)
    for axis, key in zip(axes.flat, panels, strict=False):
        if key == "trial index":
            xs: list[Any] = [index if index is not None else i
                             for i, (_, _, index, _) in enumerate(points)]
            axis.set_xlabel("trial index")
            best_x = xs[0] if points else None
        else:
            texts = [values.get(key) for _, values, _, _ in points]
            numbers = [_number(text) for text in texts]
            domain = space.get(key)
            axis.set_xlabel(f"{key_symbol(key)} ({key})")
            if points and all(number is not None for number in numbers):
                xs = numbers
                positive = [x for x in xs if x > 0]
                if (domain is not None and domain.kind == "loguniform") or (
                        len(positive) == len(xs) and max(xs) / min(xs) > 100):
                    axis.set_xscale("log")
                    # Plain numbers (0.2, not 2×10⁻¹), and more than the powers of ten on a
                    # narrow range (a search range often lies within one decade).
                    span = max(positive) / min(positive) if positive else math.inf
                    label = _log_tick_label(tuple(range(1, 10)) if span <= 10 else (1, 2, 5)
                                            if span <= 100 else (1,))
                    axis.xaxis.set_major_formatter(FuncFormatter(label))
                    axis.xaxis.set_minor_formatter(FuncFormatter(label))
                if domain is not None and domain.choice is not None \
                        and len(domain.choice) <= 12:
                    axis.set_xticks(sorted({float(value) for value in domain.choice}),
                                    [f"{float(value):g}" for value in sorted(
                                        {float(value) for value in domain.choice})])
            else:  # categories, in the order the domain lists them, then as met
                order = [str(value) for value in (domain.choice or [])] if domain else []
                order += [text for text in dict.fromkeys(str(t) for t in texts)
                          if text not in order]
                xs = [order.index(str(text)) for text in texts]
                axis.set_xticks(range(len(order)), order, rotation=30 if len(order) > 4 else 0)
            best_x = xs[0] if points else None
        ys = [value for *_, value in points]
        axis.scatter(xs, ys, s=28, color="tab:blue", alpha=0.8, label="trial")
        if best is not None:
            axis.scatter([best_x], [best[3]], s=140, marker="*", color="tab:red", zorder=3,
                         label=f"best: {best[0]}")
        axis.set_ylabel(table.metric)
        axis.grid(alpha=0.3)
    if best is not None:
        axes.flat[0].legend(fontsize=7, loc="best")
    else:
        axes.flat[0].text(0.5, 0.5, f"no trial reported {table.metric} yet", ha="center",
                          va="center", transform=axes.flat[0].transAxes)
    figure.suptitle(f"{table.metric} ({table.mode}): {len(points)} of {len(table.runs)} "
                    f"trial(s)")
    figure.tight_layout()
    return figure


def _log_tick_label(mantissas: tuple[int, ...]) -> Callable[[float, int], str]:
    """A log axis' tick label: the plain number where its mantissa is one of ``mantissas``."""

    def label(value: float, _position: int) -> str:
        if value <= 0:
            return ""
        mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
        return f"{value:g}" if any(abs(mantissa - m) < 1e-6 for m in mantissas) else ""

    return label


def _number(text: str | None) -> float | None:
    """A searched value's text as a number (None for text, booleans and missing values)."""
    if text is None or text in ("True", "False"):
        return None
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _searched(tag: str) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in tag.split(", ") if "=" in item)
    return {key: value for key, value in pairs}


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return str(value)
    if math.isnan(number):
        return "-"
    return f"{number:.4g}"


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True))

    return "\n".join([line(header).rstrip(), line(["-" * w for w in widths]),
                      *(line(row).rstrip() for row in rows)])


def print_leaderboard(tracking_uri: str, experiment: str, top: int = 10,
                      all_sweeps: bool = False) -> None:
    header, rows, title = leaderboard_rows(tracking_uri, experiment, top, all_sweeps)
    print(title)
    print(format_table(header, rows))
    uri = resolve_tracking_uri(tracking_uri)
    found = _client(uri).get_experiment_by_name(experiment)
    page = ""
    if found is not None:
        mode = "min" if found.tags.get(GREATER_IS_BETTER_TAG) == "False" else "max"
        page = runs_page(found.experiment_id, mode,
                         with_view=VIEW_TAG_PREFIX + LEADERBOARD_VIEW in found.tags)
    if uri.startswith(("http://", "https://")):
        print(f"\n{uri.rstrip('/')}/{page}")
    else:
        print(f"\nmlflow ui --backend-store-uri {uri}")
        if page:
            print(f"then open http://127.0.0.1:5000/{page}")


def runs_page(experiment_id: str, mode: str = "max", with_view: bool = False) -> str:
    """The MLflow UI's page of an experiment's runs, best objective first, relative to the
    server's address; ``with_view`` opens raycl's saved leaderboard view (objective, its test
    counterpart and the searched params as columns; :func:`raycl.tracking.write_leaderboard_view`).
    MLflow 3.17's UI opens an experiment on its GenAI pages unless the link (or the sidebar's
    switch, remembered per browser) selects the machine-learning workflow."""
    page = f"#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    if with_view:
        # The view holds the order too; the UI ignores a view whose link carries any search
        # parameter (orderByKey, searchFilter, ...).
        return f"{page}&viewStateShareKey={LEADERBOARD_VIEW}"
    ascending = "true" if mode == "min" else "false"
    return f"{page}&orderByKey=metrics.%60objective%60&orderByAsc={ascending}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raycl.leaderboard",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", help="MLflow experiment (default: the most recent one)")
    parser.add_argument("--top", type=int, default=10, help="rows to show")
    parser.add_argument("--all", dest="all_sweeps", action="store_true",
                        help="rank trials of every sweep in the experiment")
    parser.add_argument("--tracking-uri",
                        default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"),
                        help="MLflow URI (default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    args = parser.parse_args(argv)
    experiment = args.experiment
    if experiment is None:
        client = _client(resolve_tracking_uri(args.tracking_uri))
        runs = client.search_runs(
            [e.experiment_id for e in client.search_experiments()],
            f"tags.`{ROLE_TAG}` = 'sweep'", order_by=["attributes.start_time DESC"],
            max_results=1)
        if not runs:
            print(f"error: no raycl sweep in {args.tracking_uri}", file=sys.stderr)
            return 2
        experiment = client.get_experiment(runs[0].info.experiment_id).name
    try:
        print_leaderboard(args.tracking_uri, experiment, args.top, args.all_sweeps)
    except LookupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
