"""Two finished sweeps compared on the same data (issue 47): ``python -m raycl.compare A B``.

Each side is a sweep (an MLflow experiment's most recent parent run, or the parent run of that
sweep name), measured seed by seed (:func:`measure`):

- it ran seed confirmation (``tune.confirm``): its confirmation winner's runs (the
  configuration ranked first in its ``confirm.csv``, i.e. by validation mean), one per seed;
- else its trials differ only by their seed (an empty search space, repeated): every trial;
- else its best trial alone (by the validation objective, among those that may be ranked):
  one value, no interval, and the output says so.

Where the two sides share at least two seeds, the comparison is paired: the seed-by-seed
difference A − B, its mean and 95 % t-interval, separated when the interval excludes 0 (the
same difference on every seed: no spread, no interval, as
:func:`raycl.sweep.confirmation.separation_sentence` says it). Otherwise it is unpaired, said
so with why: each side's mean and interval, separated when the intervals do not overlap. The
validation objective decides; its test counterpart is reported beside it, never deciding.

Refused (:class:`CompareRefused`, one line): an unknown experiment or sweep, the two sweeps on
different data (:func:`data_identity`), different objectives, or a side with no value.
The statistics are :mod:`raycl.sweep.confirmation`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from raycl.config.sweep import reported_test_metric, resolve_tracking_uri
from raycl.sweep.confirmation import (
    CONFIDENCE,
    CONFIRM_TAG,
    Confirmed,
    intervals_overlap,
    paired_differences,
    ranked_by_validation,
    t_interval,
)
from raycl.tracking.confirm_summary import latest_sweep, read_confirm_csv
from raycl.tracking.runs import ROLE_TAG, SEARCHED_TAG, SWEEP_TAG, mlflow_client, rankable
from raycl.tracking.trial_table import searched_values, trial_runs, trial_table

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

# The parent run's params that say which data its trials saw (raycl.tracking.sweep_params logs
# the flattened config): what is drawn, from where, how large, and how it is split. How the
# data is loaded (loader, workers, cache) changes no image and is not compared.
DATA_PARAMS: tuple[str, ...] = (
    "data.dataset", "data.root", "data.resolution", "data.samples_per_combination",
    "data.num_samples", "data.val_fraction", "data.test_fraction", "data.captions",
    "data.layout")
DATA_SEED = "data seed"
PERCENT = f"{CONFIDENCE:.0%}".replace("%", " %")


class CompareRefused(ValueError):
    """Two sweeps that cannot be compared; the message is one line."""


@dataclass
class Side:
    """One sweep and what it measured.

    Attributes:
        letter: ``A`` or ``B``.
        name: the experiment (or sweep) name as given.
        parent: the sweep's parent run.
        source: how it was measured: ``confirmation``, ``seed repeats`` or ``best trial``.
        what: a phrase naming what was measured (``confirmation winner #1 (lr=0.001), 3 of 3
            seeds``).
        measured: its validation and test values with their seeds.
    """

    letter: str
    name: str
    parent: Run
    source: str
    what: str
    measured: Confirmed


@dataclass
class Comparison:
    """Two sides on one objective (``metric``, ``mode``) and its test counterpart."""

    first: Side
    second: Side
    metric: str
    test_metric: str | None
    mode: str
    data: dict[str, str]


def find_sweep(client: MlflowClient, name: str) -> tuple[str, Run]:
    """The experiment id and parent run of the sweep ``name``: the experiment's most recent
    sweep, else the most recent parent run whose sweep is called ``name`` (tag
    ``raycl.sweep``), in any experiment.

    Raises:
        CompareRefused: neither exists.
    """
    found = client.get_experiment_by_name(name)
    if found is not None:
        parent = latest_sweep(client, name)
        if parent is None:
            raise CompareRefused(f"experiment {name!r} has no raycl sweep")
        return found.experiment_id, parent
    ids = [experiment.experiment_id for experiment in client.search_experiments()]
    runs = client.search_runs(ids, f"tags.`{ROLE_TAG}` = 'sweep' and tags.`{SWEEP_TAG}` = "
                              f"'{name}'", order_by=["attributes.start_time DESC"],
                              max_results=1) if ids else []
    if not runs:
        raise CompareRefused(f"no experiment or sweep named {name!r}")
    return runs[0].info.experiment_id, runs[0]


def data_identity(parent: Run) -> dict[str, str]:
    """What a sweep's parent run says of its data: each of :data:`DATA_PARAMS` it logged, and
    the data seed (``data.seed``; else ``seed``, which draws the data too; else, for seed
    repeats, each trial's own seed: ``each trial's seed (grid [0, 1, 2])``)."""
    params = parent.data.params
    identity = {key: params[key] for key in DATA_PARAMS if key in params}
    if params.get("data.seed", "None") not in ("None", ""):
        identity[DATA_SEED] = params["data.seed"]
    elif "seed" in params:
        identity[DATA_SEED] = params["seed"]
    elif "search_space.seed" in params:
        identity[DATA_SEED] = f"each trial's seed ({params['search_space.seed']})"
    return identity


def check_comparable(first: tuple[str, Run], second: tuple[str, Run]) -> dict[str, str]:
    """The data both sweeps ran on; refused when their objectives or data differ.

    Args:
        first, second: ``(name, parent run)`` of each sweep.

    Returns:
        :func:`data_identity` of the first (the keys both logged).

    Raises:
        CompareRefused: another objective or mode, or other data (a key both logged with
            different values).
    """
    (name_a, run_a), (name_b, run_b) = first, second
    objectives = [(run.data.tags.get("raycl.metric", "val/linear/mean"),
                   run.data.tags.get("raycl.mode", "max")) for run in (run_a, run_b)]
    if objectives[0] != objectives[1]:
        (metric_a, mode_a), (metric_b, mode_b) = objectives
        raise CompareRefused(f"{name_a} and {name_b} have different objectives ({metric_a} "
                             f"{mode_a} vs {metric_b} {mode_b}): their winners were chosen on "
                             f"different numbers")
    data_a, data_b = data_identity(run_a), data_identity(run_b)
    differ = [f"{key} {data_a[key]} vs {data_b[key]}" for key in data_a
              if key in data_b and data_a[key] != data_b[key]]
    if differ:
        raise CompareRefused(f"{name_a} and {name_b} ran on different data ({'; '.join(differ)})"
                             f": compare sweeps on the same data")
    return {key: value for key, value in data_a.items() if key in data_b}


def _seed(run: Run, parent: Run) -> int | None:
    """The seed a trial trained with: its ``seed`` param, else its searched seed, else its
    sweep's ``seed`` (what every search trial trains with); None when none is recorded."""
    for text in (run.data.params.get("seed"),
                 searched_values(run.data.tags.get(SEARCHED_TAG, "")).get("seed"),
                 parent.data.params.get("seed")):
        try:
            return int(str(text))
        except ValueError:
            continue
    return None


def _measured(runs: list[Run], parent: Run, metric: str, rank: int = 1,
              values: dict[str, str] | None = None) -> Confirmed:
    """The validation ``metric`` and its test counterpart of each of ``runs`` that may be ranked
    and reported it, with its seed; the others named in ``dropped`` (by seed) with how they
    ended."""
    test_metric = reported_test_metric(metric)
    seeds = [_seed(run, parent) for run in runs]
    item = Confirmed(rank, dict(values or {}), [seed for seed in seeds if seed is not None])
    for run, seed in zip(runs, seeds, strict=True):
        value = run.data.metrics.get(metric, math.nan)
        if seed is None:  # unpairable and unnamed: no raycl run lacks its seed
            continue
        if not rankable(run) or not math.isfinite(value):
            item.dropped[seed] = run.data.tags.get("raycl.ended", run.info.status.lower())
            continue
        item.add(seed, value, run.data.metrics.get(test_metric) if test_metric else None)
    return item


def _confirmation_winner(client: MlflowClient, parent: Run, runs: list[Run], metric: str,
                         objective: str, mode: str) -> Confirmed:
    """The confirmation's winner measured on ``metric`` over its seeds: the rank first in
    ``confirm.csv``, else (no file) the best mean of the ranks' runs on the ``objective``."""
    by_rank: dict[int, list[Run]] = {}
    for run in runs:
        by_rank.setdefault(int(run.data.tags[CONFIRM_TAG]), []).append(run)
    table = read_confirm_csv(client, parent.info.run_id)
    rank = table[1][0][0] if table and table[1] and table[0][0] == "rank" else None
    if rank not in by_rank:
        rank = ranked_by_validation([_measured(own, parent, objective, number)
                                     for number, own in sorted(by_rank.items())], mode)[0].rank
    return _measured(by_rank[rank], parent, metric, rank, _values(by_rank[rank][0]))


def _values(run: Run) -> dict[str, str]:
    """A run's searched values but its seed (a confirmation run's seed is its case)."""
    values = searched_values(run.data.tags.get(SEARCHED_TAG, ""))
    values.pop("seed", None)
    return values


def measure(client: MlflowClient, experiment_id: str, parent: Run, metric: str, mode: str,
            objective: str | None = None) -> tuple[str, str, Confirmed]:
    """What a sweep measured, seed by seed (the module's three cases).

    Args:
        client: the store; ``experiment_id``, ``parent``: the sweep's experiment and parent run.
        metric: the validation metric measured; ``mode``: ``max`` or ``min``.
        objective: the sweep's objective, which chooses its winner or best trial (None: the
            ``metric``).

    Returns:
        ``(source, what, measured)``: ``confirmation``, ``seed repeats`` or ``best trial``; a
        phrase that names it; the values with their seeds (rank 1).
    """
    confirmation = trial_runs(client, experiment_id, parent.info.run_id, confirmation=True)
    if confirmation:
        item = _confirmation_winner(client, parent, confirmation, metric, objective or metric,
                                    mode)
        return "confirmation", f"confirmation winner {item.label}, {item.share} seeds", item
    trials = trial_runs(client, experiment_id, parent.info.run_id)
    # raycl.searched is set last on a trial's run: one without it says nothing of its values.
    described = [run for run in trials if SEARCHED_TAG in run.data.tags]
    if described and all(set(searched_values(run.data.tags[SEARCHED_TAG])) == {"seed"}
                         for run in described):
        item = _measured(trials, parent, metric)
        return "seed repeats", (f"seed repeats of one configuration, {item.share} trials "
                                f"finished"), item
    best = trial_table(trials, objective or metric, mode).best()
    if best is None:
        return "best trial", "no trial", Confirmed(1, {}, [])
    item = _measured([best], parent, metric, 1, searched_values(
        best.data.tags.get(SEARCHED_TAG, "")))
    name = best.info.run_name or best.info.run_id
    return "best trial", (f"best trial {name} alone (no confirmation, no seed repeats): one "
                          f"value, no interval"), item


def compare_sweeps(tracking_uri: str, first: str, second: str, metric: str | None = None
                   ) -> Comparison:
    """Compare the sweeps ``first`` (A) and ``second`` (B) of the store ``tracking_uri``.

    Args:
        metric: the validation metric compared (None: the sweeps' objective).

    Raises:
        CompareRefused: an unknown sweep, other data or objectives, or a side without a value
            of the metric.
    """
    uri = resolve_tracking_uri(tracking_uri)
    database = uri.removeprefix("sqlite:///")
    if database != uri and not Path(database).is_file():  # MLflow would create an empty one
        raise CompareRefused(f"no MLflow store at {uri} (no such file); pass --tracking-uri")
    client = mlflow_client(uri)
    found = [(name, *find_sweep(client, name)) for name in (first, second)]
    data = check_comparable((first, found[0][2]), (second, found[1][2]))
    objective = found[0][2].data.tags.get("raycl.metric", "val/linear/mean")
    mode = found[0][2].data.tags.get("raycl.mode", "max")
    metric = metric or objective
    sides = []
    for letter, (name, experiment_id, run) in zip("AB", found, strict=True):
        source, what, measured = measure(client, experiment_id, run, metric, mode, objective)
        if not measured.val:
            raise CompareRefused(f"{name}: no finished trial reported {metric}")
        sides.append(Side(letter, name, run, source, what, measured))
    return Comparison(sides[0], sides[1], metric, reported_test_metric(metric), mode, data)


def _interval(values: list[float]) -> str:
    """``0.812 [0.79, 0.83] (n=3)``; one value: ``0.812 (n=1, no interval)``; none: ``-``."""
    mean, low, high = t_interval(values)
    if math.isnan(mean):
        return "-"
    if math.isnan(low):
        return f"{mean:.4g} (n={len(values)}, no interval)"
    return f"{mean:.4g} [{low:.4g}, {high:.4g}] (n={len(values)})"


def _better(difference: float, mode: str) -> str:
    """``; A is better (max)``: which side a separating difference A − B favours."""
    return f"; {'A' if (difference > 0) == (mode == 'max') else 'B'} is better ({mode})"


def _paired_verdict(differences: list[float], metric: str, mode: str) -> tuple[str, str]:
    """The paired difference's cell and sentence on ``metric`` (A − B over shared seeds)."""
    count = len(differences)
    if max(differences) - min(differences) <= 1e-9:
        # Every seed moved both alike: a zero-width interval would claim a certainty the seeds
        # do not give (as separation_sentence says it).
        return (f"{differences[0]:+.4g} on each seed (n={count}, no spread)",
                f"A and B differ by {differences[0]:+.4g} on each of {count} shared seeds on "
                f"{metric}: no spread, no {PERCENT} interval; compare over more seeds")
    mean, low, high = t_interval(differences)
    separated = not low <= 0.0 <= high
    return (f"{mean:+.4g} [{low:.4g}, {high:.4g}] (n={count})",
            f"A and B are {'' if separated else 'not '}separated at {PERCENT} on {metric}: "
            f"paired difference A − B {mean:+.4g} [{low:.4g}, {high:.4g}] over {count} shared "
            f"seeds" + (_better(mean, mode) if separated else ""))


def _verdict(comparison: Comparison, split: str) -> tuple[str, str]:
    """The ``A − B`` cell and the verdict sentence on ``split`` (``val``: the objective,
    ``test``: its counterpart)."""
    first, second = comparison.first.measured, comparison.second.measured
    metric = comparison.metric if split == "val" else comparison.test_metric or ""
    differences = paired_differences(first, second, split)
    if len(differences) >= 2:
        return _paired_verdict(differences, metric, comparison.mode)
    shared = len(differences)
    why = "no shared seeds" if shared == 0 else "1 shared seed, too few to pair"
    mine, theirs = getattr(first, split), getattr(second, split)
    if not mine or not theirs:
        return "-", f"{metric}: not reported by both sides"
    separated = not intervals_overlap(t_interval(mine)[1:], t_interval(theirs)[1:])
    difference = t_interval(mine)[0] - t_interval(theirs)[0]
    return (f"unpaired: {why}",
            f"A and B are {'' if separated else 'not '}separated at {PERCENT} on {metric} "
            f"(unpaired, {why}: each side's interval, over {len(mine)} and {len(theirs)} "
            f"values)" + (_better(difference, comparison.mode) if separated else ""))


def comparison_lines(comparison: Comparison) -> list[str]:
    """The comparison as printed: the objective and the data, each side and what it measured,
    a table (each side's mean and interval, the difference), then the verdict on the objective
    (what decides) and the test counterpart's (reported, never deciding)."""
    metric, test = comparison.metric, comparison.test_metric
    data = ", ".join(f"{key} {value}" for key, value in comparison.data.items()) or "not logged"
    lines = [f"compare A = {comparison.first.name} vs B = {comparison.second.name} on {metric} "
             f"({comparison.mode}; decides)"
             + (f", {test} reported beside it, never deciding" if test else ""),
             f"same data: {data}"]
    lines += [f"{side.letter} {side.name}: {side.what}; seeds {_seeds(side.measured)}"
              for side in (comparison.first, comparison.second)]
    splits = ["val"] + (["test"] if test else [])
    verdicts = {split: _verdict(comparison, split) for split in splits}
    table = [["", *(f"{metric} (decides)" if split == "val" else f"{test} (reported)"
                    for split in splits)]]
    for side in (comparison.first, comparison.second):
        table.append([side.letter, *(_interval(getattr(side.measured, split))
                                     for split in splits)])
    table.append(["A − B", *(verdicts[split][0] for split in splits)])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines += ["  " + "  ".join(cell.ljust(width) for cell, width in
                               zip(row, widths, strict=True)).rstrip() for row in table]
    lines.append(f"verdict: {verdicts['val'][1]}")
    if test:
        lines.append(f"test (reported, never deciding): {verdicts['test'][1]}")
    return lines


def _seeds(item: Confirmed) -> str:
    """``10000 10001 10002`` (the seeds measured), with the dropped ones and how they ended."""
    shown = " ".join(map(str, sorted(item.val_seeds))) or "-"
    return shown + (f" (dropped: {item.dropped_text})" if item.dropped else "")


__all__ = ["DATA_PARAMS", "CompareRefused", "Comparison", "Side", "check_comparable",
           "compare_sweeps", "comparison_lines", "data_identity", "find_sweep", "measure"]
