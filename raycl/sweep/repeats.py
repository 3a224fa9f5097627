"""Seed repeats: a sweep with an empty search space runs one configuration over ``seed``,
``seed + 1``, … (``tune.num_samples`` of them), and its answer is their mean and 95 % interval,
never its luckiest seed.

At the end of such a sweep :func:`report_repeats` writes the repeats as the parent run's
``confirm.csv`` (the table :func:`raycl.sweep.confirmation.confirm_table` makes: one row, its
seeds, how many finished, validation and test mean with their intervals), a ``Seed repeats``
section in its description and the tag ``raycl.repeats`` (one line), and returns the lines the
terminal prints under the leaderboard; the description leads with the answer. A seed that
did not finish is named, never dropped silently.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from raycl.config.schema import CoreConfig
from raycl.config.sweep import reported_test_metric, resolve_tracking_uri
from raycl.sweep.confirmation import (
    CSV_NAME,
    Confirmed,
    confirm_lines,
    confirm_table,
    leading_section,
    t_interval,
    write_confirm_csv,
)
from raycl.tracking.runs import NOTE_TAG, mlflow_client

# The parent run's one-line answer: ``val/linear/mean 0.61 [0.58, 0.64] over 4 of 4 seeds``.
REPEATS_TAG = "raycl.repeats"
# The parent's description leads with the repeats (replaced on a resume).
REPEATS_HEADING = "**Seed repeats**"


def is_seed_repeat(config: CoreConfig) -> bool:
    """Whether ``config``'s sweep repeats one configuration over seeds (nothing searched)."""
    return not config.tune.search_space and config.tune.num_samples > 1


def repeated(config: CoreConfig, results: Any) -> Confirmed:
    """The repeats' seeds with the objective (and its test counterpart) of each that finished,
    and how each other one ended (``not run``: no result at all).

    Args:
        config: the sweep's config.
        results: its Tune results (each trial's config holds its ``seed``).
    """
    from raycl.sweep.confirm_tuner import record_seed

    seeds = [config.seed + index for index in range(config.tune.num_samples)]
    item = Confirmed(1, {}, seeds)
    metric, test_metric = config.tune.metric, reported_test_metric(config.tune.metric)
    seen: set[int] = set()
    for result in results:
        seed = (result.config or {}).get("seed")
        if seed is not None:
            seen.add(int(seed))
            record_seed(item, int(seed), result, metric, test_metric)
    item.dropped.update({seed: "not run" for seed in seeds if seed not in seen})
    return item


def repeats_sentence(item: Confirmed, metric: str) -> str:
    """``val/linear/mean 0.6123 [0.5811, 0.6435] (95 %) over 4 of 4 planned seeds`` (with
    fewer than two finished seeds: no interval, said)."""
    mean, low, high = t_interval(item.val)
    if item.finished < 2:
        return (f"{metric}: no 95 % interval, {item.share} planned seeds finished"
                + (f" ({mean:.4g})" if item.finished else ""))
    return f"{metric} {mean:.4g} [{low:.4g}, {high:.4g}] (95 %) over {item.share} planned seeds"


def report_repeats(config: CoreConfig, results: Any, parent: str | None) -> list[str]:
    """Write the repeats on the sweep's ``parent`` run (``confirm.csv``, the description's
    section, :data:`REPEATS_TAG`) and return the lines to print; nothing written without a
    parent run."""
    item = repeated(config, results)
    metric = config.tune.metric
    header, rows = confirm_table([item], metric, reported_test_metric(metric), config.tune.mode)
    sentence = repeats_sentence(item, metric)
    lines = confirm_lines(header, rows, f"the sweep's answer: {sentence} (one configuration, "
                                        f"no best seed)")
    lines[0] = "seed repeats (mean and 95 % interval over seeds):"
    if parent is None:
        return lines
    client = mlflow_client(resolve_tracking_uri(config.mlflow.tracking_uri))
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory, CSV_NAME)
        write_confirm_csv(header, rows, path)
        client.log_artifact(parent, str(path))
    client.set_tag(parent, REPEATS_TAG, sentence)
    note = client.get_run(parent).data.tags.get(NOTE_TAG, "")
    block = "\n".join(lines)
    client.set_tag(parent, NOTE_TAG, leading_section(
        note, REPEATS_HEADING, f" (one configuration over seeds; the search's table below "
                               f"ranks seeds, not settings):\n\n```\n{block}\n```"))
    return lines


__all__ = [
    "REPEATS_HEADING",
    "REPEATS_TAG",
    "is_seed_repeat",
    "repeated",
    "repeats_sentence",
    "report_repeats",
]
