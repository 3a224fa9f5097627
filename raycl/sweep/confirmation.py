"""Seed confirmation (``tune.confirm: {top_k: K, seeds: S}``): the pure parts.

After a search, the K best configurations (by the validation objective) are re-run to the end
with the same S fresh seeds each (:mod:`raycl.sweep.confirm_tuner` runs them, on the search's
data unless ``tune.confirm.redraw_data``); this module chooses them, derives their seeds, and
summarises each over its seeds: mean and 95 % t-interval, validation and test, and each one's
paired difference from the winner (seed by seed: the shared seed's variance cancels), as the
rows of the parent run's ``confirm.csv`` and the lines printed at the end of the sweep. A seed
that did not finish (diverged, failed, no objective) is named in the row's ``dropped`` column
and the verdict says over how many of the planned seeds each interval is: an interval over 2
of 3 seeds is not the one that was planned.
Nothing here needs Ray or MLflow.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A confirmation trial's child run carries its configuration's rank (1 = the search's best).
CONFIRM_TAG = "raycl.confirm"
# Confirmation seeds of the configuration of rank r are seed + r * SEED_STRIDE + 0..S-1: never
# the search's own seed (the search trials all train with ``seed``), never shared between ranks
# (a trial's seed names its configuration).
SEED_STRIDE = 10_000
CONFIDENCE = 0.95
CSV_NAME = "confirm.csv"
# The start of confirm.csv's paired-difference columns: ``Δ vs #1 val/linear/mean mean``.
DELTA = "Δ vs winner "


def top_configurations(
    scored: Sequence[tuple[Mapping[str, Any], float]], top_k: int, mode: str
) -> list[dict[str, Any]]:
    """The ``top_k`` best distinct configurations of a search, best first.

    Args:
        scored: ``(searched values, objective)`` of each finished trial, in trial order.
            A non-finite objective (a trial that never reported it) is left out.
        top_k: how many to keep (fewer when fewer distinct configurations were scored).
        mode: ``"max"`` or ``"min"``: the objective's direction.

    Returns:
        The searched values, best objective first; ties keep trial order. A configuration
        tried twice counts once, at its best objective.

    Raises:
        ValueError: ``top_k`` below 1, or a ``mode`` other than max/min.
    """
    if top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    if mode not in ("max", "min"):
        raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
    best: dict[tuple[tuple[str, str], ...], tuple[float, int, dict[str, Any]]] = {}
    for order, (values, objective) in enumerate(scored):
        if not isinstance(objective, (int, float)) or not math.isfinite(objective):
            continue
        key = tuple(sorted((name, repr(value)) for name, value in values.items()))
        better = objective if mode == "max" else -objective
        if key not in best or better > best[key][0]:
            best[key] = (better, best[key][1] if key in best else order, dict(values))
    ranked = sorted(best.values(), key=lambda item: (-item[0], item[1]))
    return [values for _, _, values in ranked[:top_k]]


def chosen_configurations(
    scored: Sequence[tuple[Mapping[str, Any], float]], top_k: int, mode: str,
    per: str | None = None
) -> list[dict[str, Any]]:
    """The configurations seed confirmation re-runs: :func:`top_configurations`, or with
    ``per`` (``tune.confirm.per``, e.g. ``method``) the ``top_k`` best of each value of that key,
    the values ordered by their best objective (the overall winner's first)."""
    if per is None or not scored:
        return top_configurations(scored, top_k, mode)
    groups: dict[str, list[tuple[Mapping[str, Any], float]]] = {}
    for values, objective in scored:
        groups.setdefault(repr(values.get(per)), []).append((values, objective))
    chosen = [values for group in groups.values()
              for values in top_configurations(group, top_k, mode)]
    order = top_configurations(scored, len(scored), mode)  # every configuration, best first
    return sorted(chosen, key=order.index)


def confirmation_seeds(base_seed: int, top_k: int, seeds: int) -> list[list[int]]:
    """The fresh seeds of each confirmed configuration: ``[[seeds of rank 1], ...]``, the same
    seeds for every rank (paired: configuration A's seed s and B's seed s draw the same
    initialisation and augmentations, so their difference is measured seed by seed).

    Args:
        base_seed: the sweep's ``seed`` (what every search trial trained with).
        top_k: configurations confirmed.
        seeds: seeds per configuration, at most :data:`SEED_STRIDE`.

    Returns:
        ``base_seed + SEED_STRIDE + j`` for j 0..seeds-1, once per rank: the same for the same
        arguments (a resumed confirmation), none equal to ``base_seed``.

    Raises:
        ValueError: ``top_k`` below 1, or ``seeds`` outside [1, SEED_STRIDE].
    """
    if top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    if not 1 <= seeds <= SEED_STRIDE:
        raise ValueError(f"seeds must be in [1, {SEED_STRIDE}], got {seeds}")
    return [[base_seed + SEED_STRIDE + j for j in range(seeds)] for _ in range(top_k)]


def rank_of_seed(seed: int, base_seed: int) -> int:
    """The rank (1-based) of the configuration a confirmation ``seed`` belongs to in a
    confirmation started before seeds were paired (each rank then had seeds of its own,
    ``base_seed + rank * SEED_STRIDE + j``): a resumed one's trials carry no case key.

    Raises:
        ValueError: ``seed`` is no confirmation seed of ``base_seed``.
    """
    rank = (seed - base_seed) // SEED_STRIDE
    if rank < 1:
        raise ValueError(f"seed {seed} is not a confirmation seed of base seed {base_seed}")
    return rank


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float,
                                                                                   float]:
    """Mean and two-sided Student-t confidence interval of the mean over seeds.

    Args:
        values: one measurement per seed (non-finite ones are left out).
        confidence: the interval's coverage, in (0, 1).

    Returns:
        ``(mean, low, high)`` = mean ∓ t_{(1+c)/2, n-1} · s / √n with s the sample standard
        deviation; the bounds are NaN with fewer than 2 values, all three with none.

    Raises:
        ValueError: ``confidence`` outside (0, 1).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    finite = [float(v) for v in values if math.isfinite(v)]
    n = len(finite)
    if n == 0:
        return math.nan, math.nan, math.nan
    mean = sum(finite) / n
    if n < 2:
        return mean, math.nan, math.nan
    from scipy.stats import t  # scipy comes with scikit-learn (the probes)

    spread = math.sqrt(sum((v - mean) ** 2 for v in finite) / (n - 1))
    half = float(t.ppf((1.0 + confidence) / 2.0, n - 1)) * spread / math.sqrt(n)
    return mean, mean - half, mean + half


@dataclass
class Confirmed:
    """One confirmed configuration and what its seeds measured.

    Attributes:
        rank: its place in the search (1 = the search's best).
        values: its searched values.
        seeds: its confirmation seeds.
        val: the validation objective of each finished seed.
        test: the objective's test counterpart of each finished seed.
        dropped: each seed left out of the intervals -> how it ended (``diverged``,
            ``error``, ``skipped``, ``no val/linear/mean``, ``not run``).
    """

    rank: int
    values: dict[str, Any]
    seeds: list[int]
    val: list[float] = field(default_factory=list)
    test: list[float] = field(default_factory=list)
    dropped: dict[int, str] = field(default_factory=dict)
    # The seed of each value of ``val`` and ``test`` (what pairs two configurations).
    val_seeds: list[int] = field(default_factory=list)
    test_seeds: list[int] = field(default_factory=list)

    def add(self, seed: int, val: float, test: float | None) -> None:
        """A finished seed's validation objective and (when reported) its test counterpart."""
        self.val.append(val)
        self.val_seeds.append(seed)
        if test is not None:
            self.test.append(test)
            self.test_seeds.append(seed)

    @property
    def finished(self) -> int:
        """The seeds in the validation interval (a non-finite value is in none)."""
        return sum(math.isfinite(v) for v in self.val)

    @property
    def share(self) -> str:
        """``2 of 3``: the seeds in the interval of those planned."""
        return f"{self.finished} of {len(self.seeds)}"

    @property
    def dropped_text(self) -> str:
        """``10003 diverged; 10004 error`` ("" when every seed is in the interval)."""
        return "; ".join(f"{seed} {how}" for seed, how in sorted(self.dropped.items()))

    @property
    def label(self) -> str:
        """``#2 (simclr.temperature=0.31, train.lr=0.001)``: how sentences name it."""
        shown = ", ".join(f"{key}={_short(value)}" for key, value in self.values.items())
        return f"#{self.rank} ({shown})" if shown else f"#{self.rank}"


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def paired_differences(first: Confirmed, second: Confirmed, split: str = "val") -> list[float]:
    """``first - second`` seed by seed over the seeds both finished (``split``: ``val`` or
    ``test``), in ``first``'s order: the paired comparison's measurements (none for values
    recorded without their seeds)."""
    mine, theirs = (dict(zip(getattr(item, f"{split}_seeds"), getattr(item, split),
                             strict=False)) for item in (first, second))
    return [value - theirs[seed] for seed, value in mine.items()
            if seed in theirs and math.isfinite(value) and math.isfinite(theirs[seed])]


def ranked_by_validation(confirmed: Sequence[Confirmed], mode: str) -> list[Confirmed]:
    """``confirmed`` best validation mean first (those without one last, in rank order)."""
    def key(item: Confirmed) -> tuple[bool, float, int]:
        mean = t_interval(item.val)[0]
        if math.isnan(mean):
            return True, 0.0, item.rank
        return False, -mean if mode == "max" else mean, item.rank

    return sorted(confirmed, key=key)


def confirm_table(
    confirmed: Sequence[Confirmed], metric: str, test_metric: str | None, mode: str
) -> tuple[list[str], list[list[Any]]]:
    """The rows of ``confirm.csv``, best validation mean first.

    Args:
        confirmed: the confirmed configurations with their measurements.
        metric: the validation objective's name (``val/linear/mean``).
        test_metric: its test counterpart (None: no test columns).
        mode: ``"max"`` or ``"min"``.

    Returns:
        ``(header, rows)``: ``rank``, each searched key, ``seeds`` (``1 2 3``), ``n`` (seeds
        that finished), ``dropped`` (the others and how they ended, ``10003 diverged; 10004
        error``; "" for none), then ``<metric> mean``, ``… ci95_low``, ``… ci95_high`` for
        validation and for test. Missing numbers are NaN.
    """
    keys: list[str] = []
    for item in confirmed:
        keys += [key for key in item.values if key not in keys]
    columns = [(metric, "val")] + ([(test_metric, "test")] if test_metric else [])
    header = ["rank", *keys, "seeds", "n", "dropped"]
    for name, _ in columns:
        header += [f"{name} mean", f"{name} ci95_low", f"{name} ci95_high"]
    for name, _ in columns:  # the paired difference from the winner (its own row: NaN)
        header += [f"{DELTA}{name} mean", f"{DELTA}{name} ci95_low", f"{DELTA}{name} ci95_high"]
    rows = []
    ranked = ranked_by_validation(confirmed, mode)
    for item in ranked:
        row: list[Any] = [item.rank, *(item.values.get(key) for key in keys),
                          " ".join(map(str, item.seeds)), item.finished, item.dropped_text]
        for _, split in columns:
            row += list(t_interval(getattr(item, split)))
        for _, split in columns:
            row += list(t_interval(paired_differences(item, ranked[0], split))
                        if item is not ranked[0] else (math.nan,) * 3)
        rows.append(row)
    return header, rows


def intervals_overlap(first: tuple[float, float], second: tuple[float, float]) -> bool:
    """Whether two closed intervals ``(low, high)`` share a point; an unknown (NaN) bound
    counts as overlapping: nothing separates them."""
    if any(math.isnan(bound) for bound in (*first, *second)):
        return True
    return first[0] <= second[1] and second[0] <= first[1]


def separation_sentence(confirmed: Sequence[Confirmed], mode: str) -> str | None:
    """Whether the confirmation separates its winner from the runner-up at 95 %.

    Paired when both finished at least two of the same seeds: the interval of the seed-by-seed
    difference (:func:`paired_differences`) against 0; otherwise (seeds from before pairing,
    or too few shared) whether their two intervals overlap, said to be unpaired.

    Returns:
        ``the winner #1 (…) is separated from #2 (…) at 95 %: paired difference +0.012
        [0.004, 0.02] over 3 shared seeds`` (``is not`` when the interval holds 0), the
        unpaired sentence ``… (unpaired: intervals over 3 of 3 and 2 of 3 planned seeds)``,
        or None with fewer than two configurations.
    """
    ranked = ranked_by_validation(confirmed, mode)
    if len(ranked) < 2:
        return None
    winner, second = ranked[0], ranked[1]
    differences = paired_differences(winner, second)
    if len(differences) >= 2 and max(differences) - min(differences) <= 1e-9:
        # A coarse metric on a small split: every seed moved both alike. A zero-width interval
        # would claim a certainty the seeds do not give.
        return (f"the winner {winner.label} and {second.label} differ by "
                f"{differences[0]:+.4g} on each of {len(differences)} shared seeds: no spread, "
                f"no 95 % interval; confirm over more seeds")
    if len(differences) >= 2:
        mean, low, high = t_interval(differences)
        verb = "is not" if low <= 0.0 <= high or math.isnan(low) else "is"
        return (f"the winner {winner.label} {verb} separated from {second.label} at 95 %: "
                f"paired difference {mean:+.4g} [{low:.4g}, {high:.4g}] over "
                f"{len(differences)} shared seeds")
    first_interval, second_interval = t_interval(winner.val)[1:], t_interval(second.val)[1:]
    verb = "is not" if intervals_overlap(first_interval, second_interval) else "is"
    # A seed that diverged or failed leaves the interval narrower in count than planned: say so.
    return (f"the winner {winner.label} {verb} separated from {second.label} at 95 % "
            f"(unpaired: intervals over {winner.share} and {second.share} planned seeds)")


def verdict_sentence(confirmed: Sequence[Confirmed], mode: str) -> str | None:
    """The confirmation's last line: :func:`separation_sentence`, or with one configuration
    ``the interval of #1 (…) is over 2 of 3 planned seeds``; None with none."""
    if len(confirmed) == 1:
        (only,) = confirmed
        return f"the interval of {only.label} is over {only.share} planned seeds"
    return separation_sentence(confirmed, mode)


# Where the search's own description starts below the answer a parent run leads with.
SEARCH_HEADING = "\n\n**The search** (the trials the answer above was chosen from):\n\n"


def leading_section(note: str, heading: str, body: str) -> str:
    """A parent run's description that leads with the answer (``heading`` + ``body``: the
    confirmation or the seed repeats), the search's own description (``note``) below it; an
    earlier answer under the same heading (a resumed sweep writing it again) is replaced."""
    if note.startswith(heading):
        note = note.split(SEARCH_HEADING, 1)[1] if SEARCH_HEADING in note else ""
    return f"{heading}{body}{SEARCH_HEADING}{note}"


def write_confirm_csv(header: Sequence[str], rows: Sequence[Sequence[Any]], path: Path) -> None:
    """Write ``confirm.csv`` (floats in full precision, NaN as empty)."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for row in rows:
            writer.writerow(["" if isinstance(v, float) and math.isnan(v) else v for v in row])


def confirm_lines(header: Sequence[str], rows: Sequence[Sequence[Any]],
                  sentence: str | None) -> list[str]:
    """The confirmation as the terminal shows it: an aligned table (each ``<m> mean``,
    ``ci95_low``, ``ci95_high`` triple of :func:`confirm_table` as one ``<m>`` column,
    ``0.41 [0.38, 0.42]``), then the sentence."""
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "-" if math.isnan(value) else f"{value:.4g}"
        return "-" if value is None or value == "" else str(value)

    # Column index -> (shown name, how many cells it takes).
    spans: list[tuple[str, int]] = []
    i = 0
    while i < len(header):
        name = header[i]
        if name.endswith(" mean") and header[i + 1:i + 3] == [
                f"{name[:-5]} ci95_low", f"{name[:-5]} ci95_high"]:
            spans.append((f"{name[:-5]} (95 %)", 3))
        else:
            spans.append((name, 1))
        i += spans[-1][1]
    table = [[name for name, _ in spans]]
    for row in rows:
        shown, i = [], 0
        for _, width in spans:
            cells = [cell(v) for v in row[i:i + width]]
            shown.append(cells[0] if width == 1 or cells[1] == "-"
                         else f"{cells[0]} [{cells[1]}, {cells[2]}]")
            i += width
        table.append(shown)
    widths = [max(len(line[j]) for line in table) for j in range(len(spans))]
    lines = ["seed confirmation (mean and 95 % interval over seeds):"]
    lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip()
              for line in table]
    if sentence:
        lines.append(sentence)
    return lines


__all__ = [
    "CONFIDENCE",
    "CONFIRM_TAG",
    "CSV_NAME",
    "DELTA",
    "SEARCH_HEADING",
    "SEED_STRIDE",
    "Confirmed",
    "chosen_configurations",
    "confirm_lines",
    "confirm_table",
    "confirmation_seeds",
    "intervals_overlap",
    "leading_section",
    "paired_differences",
    "rank_of_seed",
    "ranked_by_validation",
    "separation_sentence",
    "t_interval",
    "top_configurations",
    "verdict_sentence",
    "write_confirm_csv",
]
