"""``python -m raycl.evaluate``: score finished trials' encoders on new data, without retraining.

The command's door: it parses the arguments, finds the trials (:func:`raycl.results.trials
.find_trials`), and hands each to :mod:`raycl.results.reevaluate`, which rebuilds its encoder
from its last checkpoint, reads the new data as a transfer set, scores it as a trial's own
splits are scored (one Ray task per trial; ``--no-ray`` in this process), and logs
``transfer/<name>/<family>/<attribute>`` into the trial's own MLflow run; beside it the untrained
encoder's and the raw pixels' scores, ``transfer/<name>/{at_init,pixels}/...``
(:mod:`raycl.results.references`; ``--no-references``: not). ``--features-out DIR`` writes each
share's features, labels and image ids as ``.npy``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from raycl.config.metric_names import TRANSFER
from raycl.config.schema import ConfigErrors
from raycl.config.sweep import add_tracking_uri_option
from raycl.results.reevaluate import (
    DATA_KEYS,
    UnscorableDataError,
    check_checkpoint,
    evaluation_config,
    log_scores,
    score_trial,
    score_with_ray,
    split_overrides,
    write_features,
)
from raycl.results.references import table_rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (``--help`` lists it)."""
    parser = argparse.ArgumentParser(
        prog="python -m raycl.evaluate",
        description="Score finished trials' trained encoders on new data without retraining; "
        "log transfer/<name>/... into each trial's MLflow run.")
    parser.add_argument("--experiment", required=True, help="MLflow experiment of the sweep "
                        "(its name, mlflow.experiment or the search's name).")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--trial", default="best", help="best (by the sweep's objective), a run "
                       "name such as t07, or an MLflow run id (default: best).")
    which.add_argument("--top", type=int, default=None, metavar="K",
                       help="The K best trials instead of one.")
    add_tracking_uri_option(parser)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help=f"The new data (data.{{{','.join(DATA_KEYS)}}}) "
                        "and evaluation keys (eval.*); repeatable.")
    parser.add_argument("--name", default=None, help="Name in transfer/<name>/... (default: "
                        "the dataset's name).")
    parser.add_argument("--features-out", type=Path, default=None, metavar="DIR",
                        help="Also write <DIR>/<trial, e.g. t07>/{train,test}_features.npy, "
                        "{train,test}_labels_<attribute>.npy and {train,test}_ids.npy.")
    parser.add_argument("--no-references", dest="references", action="store_false",
                        help="Score the trial's encoder alone: not also its untrained encoder "
                        "(at_init) and the raw pixels (pixels), the floor its score is read by.")
    parser.add_argument("--no-ray", action="store_true", help="Score in this process instead "
                        "of one Ray task per trial.")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: "
                        "$RAY_ADDRESS, or a local Ray started here).")
    return parser.parse_args(argv)


def print_table(rows: Sequence[tuple[str, Mapping[str, float]]], name: str) -> None:
    """One line per trial: its name, each family's ``transfer/<name>/<family>/mean`` and the
    retrieval's ``map`` (the per-attribute scores are in MLflow)."""
    prefix = f"{TRANSFER}/{name}/"
    columns = sorted({key for _, metrics in rows for key in metrics
                      if key.startswith(prefix) and key.endswith(("/mean", "/retrieval/map"))})
    heads = [column.removeprefix(prefix).removesuffix("/mean") for column in columns]
    width = max([5, *(len(run) for run, _ in rows)])
    print(f"{'trial':<{width}}  " + "  ".join(f"{head:>10}" for head in heads))
    for run, metrics in rows:
        cells = [f"{metrics[column]:>10.4f}" if column in metrics else f"{'-':>10}"
                 for column in columns]
        print(f"{run:<{width}}  " + "  ".join(cells))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m raycl.evaluate``; returns the exit code (2: bad input, one line)."""
    args = parse_args(argv)
    import raycl.methods  # noqa: F401  (fills the schema's method sections)
    from raycl.config.sweep import resolve_tracking_uri
    from raycl.results.trials import TrialLookupError, find_trials

    if args.top is not None and args.top < 1:
        print(f"error: --top: must be >= 1, got {args.top}", file=sys.stderr)
        return 2
    tracking_uri = resolve_tracking_uri(args.tracking_uri)
    try:
        data, evaluation = split_overrides(args.overrides)
        trials = find_trials(tracking_uri, args.experiment, args.trial, args.top)
        jobs = []
        for trial in trials:
            check_checkpoint(trial)  # before Ray starts: a removed checkpoint is one line
            jobs.append((trial, evaluation_config(trial.config, data, evaluation, args.name)))
    except ConfigErrors as exc:
        for line in exc.lines:
            print(f"error: {line}", file=sys.stderr)
        return 2
    except ValueError as exc:  # TrialLookupError (and ConfigError): one line
        print(f"error: {exc}", file=sys.stderr)
        return 2
    name = jobs[0][1].eval.transfer[0].label
    keep, refs = args.features_out is not None, args.references
    try:
        results = ([score_trial(trial, config, keep, None, refs) for trial, config in jobs]
                   if args.no_ray else score_with_ray(jobs, keep, args.address, refs))
    except (TrialLookupError, UnscorableDataError) as exc:  # found once the data is read
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = []
    for (trial, _), scores in zip(jobs, results, strict=True):
        log_scores(tracking_uri, trial.run_id, scores.metrics)
        if args.features_out is not None:
            write_features(scores, args.features_out / trial.label)
        rows.append((trial.label, scores.metrics))
    print_table(table_rows(rows, name), name)
    for note in dict.fromkeys(note for scores in results for note in scores.notes):
        print(note)  # a reference not scored, once however many trials
    return 0


if __name__ == "__main__":
    sys.exit(main())
