"""A sweep's leaderboard: its trial runs ranked by the objective, with every column shown.

Trials are ranked by the sweep's objective (a validation metric); the test counterpart of the
objective and of every per-attribute probe stands beside it, reported, never used to rank. A
failed, killed or running trial (not :func:`raycl.tracking.runs.rankable`) is listed under the
ranked ones, its ending in ``status``, rank ``-``.

The same table (:func:`trial_table`) is what ``python -m raycl.leaderboard`` prints
(:func:`print_leaderboard`) and what the sweep's callback writes to its parent run after every
trial: ``leaderboard.csv`` (:func:`write_csv`), ``leaderboard.png``
(:mod:`raycl.tracking.leaderboard_plot`) and the run's description (:func:`markdown_summary`).
Each is read against what :mod:`raycl.tracking.reference_points` finds in the trials' reports:
chance on val, the untrained backbone's row ("at init"), how large a difference the val split
resolves, and a stopped trial beside the winner at the same epoch. In the terminal the
searched keys are never left out for the width (:mod:`raycl.tracking.terminal_table`);
``--columns``, ``--wide`` and ``--attributes`` choose the rest (:class:`ColumnChoice`). Sits on
:mod:`raycl.tracking.runs`.
"""

from __future__ import annotations

import csv
import itertools
import math
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raycl.config.metric_names import (
    DIAG,
    I2T,
    LINEAR,
    MEAN,
    MMVP,
    NN_RETRIEVAL,
    RETRIEVAL,
    T2I,
    TEST,
    TRANSFER,
    VAL,
    ZEROSHOT,
    maybe_metric,
    metric_name,
)
from raycl.config.paper import PaperConfig, compare_to_paper, comparison_line, paper_from_params
from raycl.config.sweep import reported_test_metric, resolve_tracking_uri
from raycl.sweep.confirmation import CONFIRM_TAG
from raycl.tracking.closed_stdout import stdout_closed
from raycl.tracking.pareto import (
    OBJECTIVES_TAG,
    front_run_ids,
    front_title,
    mark_front,
    pareto_first,
    parse_objectives,
    scored_runs,
)
from raycl.tracking.reference_points import (
    BASELINE_SCOPE_TAG,
    baseline_row,
    baseline_scope_line,
    chance_line,
    honesty,
    resolution_line,
    retrieval_labels,
    same_epoch_statuses,
)
from raycl.tracking.runs import (
    GREATER_IS_BETTER_TAG,
    LEADERBOARD_VIEW,
    PARENT_TAG,
    ROLE_TAG,
    SEARCHED_TAG,
    TRIAL_TAG,
    VIEW_TAG_PREFIX,
    mlflow_client,
    mlflow_ui_command,
    rankable,
    search_all_runs,
)
from raycl.tracking.terminal_table import format_table, terminal_width

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

# Columns shown when a trial reported them (besides transfer means and the probes).
REPORTED: tuple[str, ...] = (
    metric_name(DIAG, None, "effective_rank"), metric_name(VAL, NN_RETRIEVAL, MEAN),
    metric_name(VAL, RETRIEVAL, "rank1"), metric_name(VAL, RETRIEVAL, "map"),
    metric_name(VAL, MMVP, MEAN), metric_name(TEST, MMVP, MEAN), metric_name(VAL, ZEROSHOT, MEAN),
    metric_name(VAL, I2T, "r1"), metric_name(VAL, T2I, "r1"),
)

def trial_runs(client: MlflowClient, experiment_id: str, parent_run_id: str | None,
               confirmation: bool = False) -> list[Run]:
    """The trial (child) runs of one sweep (its parent run), or of every sweep (None): the
    search's, or with ``confirmation`` its seed confirmation's (tagged ``raycl.confirm``)."""
    filter_string = f"tags.`{ROLE_TAG}` = 'trial'" + (
        "" if parent_run_id is None else f" and tags.`{PARENT_TAG}` = '{parent_run_id}'")
    runs = search_all_runs(client, [experiment_id], filter_string)  # every page: no cap
    return [run for run in runs if (CONFIRM_TAG in run.data.tags) == confirmation]


@dataclass
class TrialTable:
    """Trials ranked by the objective, best first, with every column the leaderboard shows; the
    trials that may not be ranked (:func:`~raycl.tracking.runs.rankable`) after them.

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
    # What the table is read against (:func:`honesty`): chance per attribute, the number of
    # val images scored and the random-init baseline's metrics; empty when neither the parent
    # run nor a trial reported them (runs of an older raycl).
    chance: dict[str, float] = field(default_factory=dict)
    val_size: int | None = None
    baseline: dict[str, float] = field(default_factory=dict)
    # The searched model.* keys at the base values the baseline scored (the parent's tag).
    baseline_scope: str | None = None

    def objective(self, run: Run) -> float | None:
        """The run's (last) objective, None when it has not reported one."""
        value = run.data.metrics.get(self.metric)
        return value if value is not None and math.isfinite(value) else None

    def best(self) -> Run | None:
        """The best trial's run: the first that may be ranked and reported the objective."""
        return next((r for r in self.runs if rankable(r) and self.objective(r) is not None), None)

    def ranks(self) -> list[str]:
        """Each row's rank: 1, 2, ... for the trials that may be ranked, ``-`` for the others."""
        ranked = itertools.count(1)
        return [str(next(ranked)) if rankable(run) else "-" for run in self.runs]


def trial_table(children: list[Run], metric: str, mode: str,
                paper_metric: str | None = None, parent: Run | None = None) -> TrialTable:
    """Rank ``children`` by ``metric`` (``mode`` max or min; trials without it last, those that
    may not be ranked after all: :func:`~raycl.tracking.runs.rankable`) and lay out
    the leaderboard's columns (the CLI's table and the parent run's ``leaderboard.csv``);
    ``paper_metric`` (the ``paper:`` block's) is a column too, after the objective's test
    counterpart. ``parent``: the sweep's parent run, whose baseline and chance are read first
    (:func:`~raycl.tracking.reference_points.honesty`)."""

    def score(run: Run) -> tuple[bool, float]:
        value = run.data.metrics.get(metric, math.nan)
        if math.isnan(value):
            return not rankable(run), math.inf
        return not rankable(run), -value if mode == "max" else value

    children = sorted(children, key=score)
    searched = sorted({key for run in children
                       for key in searched_values(run.data.tags.get(SEARCHED_TAG, ""))})
    objective_test = reported_test_metric(metric)
    names = {key: maybe_metric(key) for run in children for key in run.data.metrics}
    attributes = sorted({name.name for name in names.values() if name and name.split == VAL
                         and name.family == LINEAR and name.percent is None
                         and name.stage is None})
    # Reported beside the objective, never ranked on: transfer means, the effective rank,
    # (NNCLR, All4One) the support set's NN-retrieval accuracy, image retrieval (rank-1, mAP)
    # and (CLIP) the MMVP-style pairs, zero-shot accuracy and caption retrieval.
    reported = sorted({key for key, name in names.items() if name and name.split == TRANSFER
                       and name.stage is None and name.name == MEAN})
    reported += [key for key in REPORTED
                 if key != metric and any(key in run.data.metrics for run in children)]
    extra = [*reported, *[key for attribute in attributes
                          for key in (metric_name(VAL, LINEAR, attribute),
                                      metric_name(TEST, LINEAR, attribute))
                          if key not in (metric, objective_test)]]
    tested = [objective_test] if objective_test else []
    if paper_metric and paper_metric not in (metric, *tested):
        extra = [paper_metric, *[key for key in extra if key != paper_metric]]
    header = ["trial", "trial_id", "status", metric, *tested, *searched, *extra]
    rows = []
    for run in children:
        values = searched_values(run.data.tags.get(SEARCHED_TAG, ""))
        rows.append([run.info.run_name or run.info.run_id[:8],
                     run.data.tags.get(TRIAL_TAG, ""),
                     run.data.tags.get("raycl.ended", run.info.status.lower()),
                     *[run.data.metrics.get(key) for key in (metric, *tested)],
                     *[values.get(key) for key in searched],
                     *[run.data.metrics.get(key) for key in extra]])
    scope = parent.data.tags.get(BASELINE_SCOPE_TAG) if parent is not None else None
    return TrialTable(metric, mode, objective_test, searched, header, rows, children,
                      *honesty(children, parent), baseline_scope=scope)


def _resolution_line(table: TrialTable) -> str | None:
    """:func:`~raycl.tracking.reference_points.resolution_line` at the best trial's objective."""
    best = table.best()
    return resolution_line(table.metric, table.objective(best) if best else None,
                           table.val_size)


def write_csv(table: TrialTable, path: Path) -> None:
    """The table as CSV, best first, with a ``rank`` column (``-`` for a trial not ranked);
    numbers at full precision, an empty cell where a trial lacks the metric; the untrained
    backbone's row last (rank ``baseline``) when the trials reported one."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["rank", *table.header])
        for rank, row in zip(table.ranks(), table.rows, strict=True):
            writer.writerow([rank, *["" if value is None else value for value in row]])
        base = baseline_row(table.header, table.searched, table.baseline)
        if base is not None:  # unranked: the untrained backbone, read against
            writer.writerow(["baseline", *["" if value is None else value for value in base]])


def paper_line(table: TrialTable, paper: PaperConfig) -> str:
    """The best trial's (ranked first on the objective, never on test) value of the paper's
    metric beside the paper's, with the difference (:func:`raycl.config.paper.comparison_line`).
    """
    best = table.best()
    if best is None:
        return (f"paper ({paper.table}): {paper.metric} {paper.value:g}"
                f"{' %' if paper.unit == 'percent' else ''}; no finished trial has reported "
                f"{table.metric} yet")
    name = best.info.run_name or best.info.run_id[:8]
    return comparison_line(compare_to_paper(paper, best.data.metrics.get(paper.metric)), name,
                           table.metric)


def markdown_summary(table: TrialTable, sweep: str, top: int = 10,
                     paper: PaperConfig | None = None) -> str:
    """A short markdown description of the sweep for its parent run's page: the objective, the
    best trial so far (beside the ``paper:`` block's number, when the sweep has one) and the top
    rows (a trial not ranked: rank ``-``)."""
    scored = [run for run in table.runs if table.objective(run) is not None]
    tested = f"; its test counterpart `{table.objective_test}` is reported, not ranked on" \
        if table.objective_test else ""
    lines = [f"**{sweep}**: objective = `{table.metric}` ({table.mode}), logged by every trial "
             f"also as `objective`; trials ranked by it{tested}. "
             f"{len(scored)} of {len(table.runs)} trial(s) reported it{_unranked(table)}."]
    if (winner := table.best()) is not None:
        best = table.rows[table.runs.index(winner)]
        test_note = f", test {_fmt(best[4])}" if table.objective_test else ""
        lines.append(f"Best so far: **{_cell(best[0])}** ({_fmt(best[3])}{test_note}).")
    if paper is not None:
        lines.append(f"Against the paper: {paper_line(table, paper)}"
                     + (f" ({paper.note})" if paper.note else "") + ".")
    # What the numbers are read against: chance, the random-init backbone, val's resolution.
    if table.baseline.get(table.metric) is not None:
        lines.append(f"Random init (the same backbone untrained, the same probes): "
                     f"{_fmt(table.baseline[table.metric])}.")
        scope = baseline_scope_line(table.baseline_scope)
        if scope:
            lines.append(f"{scope[0].upper()}{scope[1:]}.")
    lines += [f"{line[0].upper()}{line[1:]}." for line in (chance_line(table.chance),
                                                           _resolution_line(table)) if line]
    columns = 5 if table.objective_test else 4
    lines += ["", "| # | " + " | ".join(_cell(name) for name in table.header[:columns]
                                        if name != "trial_id") + " |",
              "|---" * (columns) + "|"]
    for rank, row in zip(table.ranks()[:top], table.rows[:top], strict=True):
        cells = [row[0], row[2], *[_fmt(value) for value in row[3:columns]]]
        lines.append(f"| {rank} | " + " | ".join(_cell(cell) for cell in cells) + " |")
    lines += ["", "Every trial and column: artifact `leaderboard.csv`; the objective against "
              "each searched parameter: `leaderboard.png`."]
    return "\n".join(lines)


def _unranked(table: TrialTable) -> str:
    """``; N not ranked (...)`` for the trials that may not be ranked, "" when there is none."""
    count = table.ranks().count("-")
    return f"; {count} not ranked (failed, killed or still running): rank -" if count else ""


def _cell(value: object) -> str:
    """``value`` safe inside a markdown table cell."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def searched_values(tag: str) -> dict[str, str]:
    """A child run's ``raycl.searched`` tag (``key=value, ...``) as key -> value text."""
    pairs = (item.split("=", 1) for item in tag.split(", ") if "=" in item)
    return {key: value for key, value in pairs}


def _fmt(value: object) -> str:
    """A cell of the terminal's table: a number to 4 significant digits, "-" where missing."""
    if value is None:
        return "-"
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return str(value)
    if math.isnan(number):
        return "-"
    return f"{number:.4g}"


@dataclass(frozen=True)
class ColumnChoice:
    """Which columns the terminal's table shows (``python -m raycl.leaderboard`` flags).

    Attributes:
        columns: ``--columns a,b,c``: these columns (by header name) after the ones always
            shown (``#``, trial, status, the objective) and the searched keys; None: every one.
        wide: ``--wide``: no width limit (nothing left out for the terminal).
        attributes: ``--attributes``: the per-attribute probe columns too (``val/linear/
            shape``, ...); without it they are left out (they stay in ``leaderboard.csv``).
    """

    columns: tuple[str, ...] | None = None
    wide: bool = False
    attributes: bool = False


@dataclass
class Leaderboard:
    """The terminal's leaderboard: its table and the lines it is read against.

    Attributes:
        header: column names (``#`` first; no ``trial_id``).
        rows: the ranked trials' cells, best first.
        title: the line above the table.
        searched: the searched keys' column names (never left out for the width).
        baseline: the random-init row's cells (rank ``-``), None without a baseline.
        notes: lines under the table: chance, the val split's resolution, the paper's.
    """

    header: list[str]
    rows: list[list[str]]
    title: str
    searched: list[str]
    baseline: list[str] | None = None
    notes: list[str] = field(default_factory=list)


def leaderboard_rows(tracking_uri: str, experiment: str, top: int = 10, all_sweeps: bool = False
                     ) -> tuple[list[str], list[list[str]], str]:
    """Header, rows and a title line for the leaderboard (raises LookupError when empty)."""
    board = build_leaderboard(tracking_uri, experiment, top, all_sweeps)
    return board.header, board.rows, board.title


def _is_attribute_column(name: str, table: TrialTable, paper_metric: str | None) -> bool:
    """A per-attribute probe column (``val/linear/shape``), other than the objective, its test
    counterpart and the paper's metric: shown with ``--attributes``."""
    parsed = maybe_metric(name)
    return (parsed is not None and parsed.split in (VAL, TEST) and parsed.name != MEAN
            and parsed.family == LINEAR and parsed.percent is None
            and name not in (table.metric, table.objective_test, paper_metric))


def build_leaderboard(
    tracking_uri: str, experiment: str, top: int = 10, all_sweeps: bool = False,
    choice: ColumnChoice | None = None,
) -> Leaderboard:
    """The leaderboard of ``experiment``'s latest sweep (every sweep's trials with
    ``all_sweeps``): the ranked table (columns per ``choice``; None: every column), the
    random-init row, a stopped trial's status beside the winner's objective at the same epoch,
    and the chance, resolution and paper lines.

    Raises:
        LookupError: no such experiment, or no raycl sweep in it.
    """
    client = mlflow_client(resolve_tracking_uri(tracking_uri))
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
    paper = paper_from_params(parents[0].data.params)
    paper_metric = paper.metric if paper else None
    table = trial_table(children, metric, mode, paper_metric, parents[0])
    # A multi-objective sweep: its Pareto front first, marked (raycl.tracking.pareto).
    objectives = parse_objectives(parents[0].data.tags.get(OBJECTIVES_TAG, ""))
    front = front_run_ids(table.runs, objectives) if objectives else set()
    if objectives:
        table.runs, table.rows = pareto_first(table.runs, table.rows, front)
    statuses = same_epoch_statuses(client, table.runs, metric, table.best())
    shown = select_columns(table, choice or ColumnChoice(attributes=True), paper_metric)
    header = retrieval_labels(["#", *[table.header[i] for i in shown]], children, parents[0])
    rows = []  # a trial not ranked: rank "-"
    for rank, run, row in zip(table.ranks()[:top], table.runs[:top], table.rows[:top],
                              strict=True):
        cells = [*row[:2], statuses.get(run.info.run_id, row[2]), *row[3:]]
        rows.append([rank, *[_fmt(cells[i]) if i > 2 else str(cells[i]) for i in shown]])
    base = baseline_row(table.header, table.searched, table.baseline)
    baseline = ["-", *[_fmt(base[i]) if i > 2 else str(base[i]) for i in shown]] \
        if base else None
    title = (f"{experiment}: {len(children)} trial(s), best {top} by {metric} ({mode})"
             f"{'' if all_sweeps else ', latest sweep'}; test/, transfer/ and diag/ columns are "
             f"reported, not ranked on{_unranked(table)}")
    tags = {} if all_sweeps else parents[0].data.tags  # tracking.importance's, rung_agreement's
    notes = [line for line in (baseline_scope_line(table.baseline_scope) if base else None,
                               chance_line(table.chance), _resolution_line(table),
                               paper_line(table, paper) if paper else None,
                               tags.get("raycl.importance"), tags.get("raycl.rung_agreement"))
             if line]
    if objectives:
        header, rows, baseline = mark_front(header, rows, table.runs[:top], front, objectives,
                                            _fmt, baseline)
        title += "; " + front_title(objectives, len(front),
                                    len(scored_runs(table.runs, [m for m, _ in objectives])))
    return Leaderboard(header, rows, title, list(table.searched), baseline, notes)


def select_columns(table: TrialTable, choice: ColumnChoice,
                   paper_metric: str | None = None) -> list[int]:
    """The indices of ``table.header`` the terminal shows, in order: the trial's name, status
    and objective always, then the searched keys always, then the others ``choice`` keeps
    (``trial_id`` never: it is in ``leaderboard.csv``).

    Raises:
        ValueError: a name in ``choice.columns`` that is no column of the table (the message
            lists them).
    """
    always = {"trial", "status", table.metric, *table.searched}
    if choice.columns is not None:
        unknown = [name for name in choice.columns if name not in table.header]
        if unknown:
            raise ValueError(f"--columns: no column {', '.join(map(repr, unknown))}; the "
                             f"table has {', '.join(table.header[3:])}")
        picked = [i for i, name in enumerate(table.header) if name in always]
        picked += [table.header.index(name) for name in choice.columns
                   if table.header.index(name) not in picked]
        return sorted(picked, key=lambda i: (i >= 3 and table.header[i] not in always, i))
    return [i for i, name in enumerate(table.header) if name != "trial_id" and (
        choice.attributes or not _is_attribute_column(name, table, paper_metric))]


def print_leaderboard(tracking_uri: str, experiment: str, top: int = 10,
                      all_sweeps: bool = False, choice: ColumnChoice | None = None) -> None:
    """Print the leaderboard (columns per ``choice``; None: the default, per-attribute
    columns left out), the lines it is read against and where to see it in MLflow's UI (the
    link opens its view). A reader that stopped early (``| head``) ends the printing quietly,
    stdout sent to devnull.

    Raises:
        LookupError: no such experiment or sweep.
        ValueError: a ``--columns`` name the table does not have.
    """
    board = build_leaderboard(tracking_uri, experiment, top, all_sweeps, choice or ColumnChoice())
    try:
        _print_table(tracking_uri, experiment, board, choice or ColumnChoice())
        sys.stdout.flush()  # here, not at exit, where a closed pipe would print a traceback
    except BrokenPipeError:
        stdout_closed()


def _print_table(tracking_uri: str, experiment: str, board: Leaderboard,
                 choice: ColumnChoice) -> None:
    width = terminal_width()
    print(textwrap.fill(board.title, width=max(width, 40)))
    rows = [*board.rows, *([board.baseline] if board.baseline else [])]
    print(format_table(board.header, rows, width=None if choice.wide else width,
                       keep=board.searched))
    for note in board.notes:
        print(textwrap.fill(note, width=max(width, 40)))
    uri = resolve_tracking_uri(tracking_uri)
    found = mlflow_client(uri).get_experiment_by_name(experiment)
    page = ""
    if found is not None:
        mode = "min" if found.tags.get(GREATER_IS_BETTER_TAG) == "False" else "max"
        page = runs_page(found.experiment_id, mode,
                         with_view=VIEW_TAG_PREFIX + LEADERBOARD_VIEW in found.tags)
    if uri.startswith(("http://", "https://")):
        print(f"\n{uri.rstrip('/')}/{page}")
    else:
        print(f"\n{mlflow_ui_command(uri)}")  # runnable as printed, venv activated or not
        if page:
            print(f"then open http://127.0.0.1:5000/{page}")


def runs_page(experiment_id: str, mode: str = "max", with_view: bool = False) -> str:
    """The MLflow UI's page of an experiment's runs, best objective first, relative to the
    server's address; ``with_view`` opens raycl's saved leaderboard view (objective, its test
    counterpart and the searched params as columns;
    :func:`raycl.tracking.runs.write_leaderboard_view`). MLflow 3.17's UI opens an experiment
    on its GenAI pages unless the link (or the sidebar's switch, remembered per browser) selects
    the machine-learning workflow."""
    page = f"#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    if with_view:
        # The view holds the order too; the UI ignores a view whose link carries any search
        # parameter (orderByKey, searchFilter, ...).
        return f"{page}&viewStateShareKey={LEADERBOARD_VIEW}"
    ascending = "true" if mode == "min" else "false"
    return f"{page}&orderByKey=metrics.%60objective%60&orderByAsc={ascending}"
