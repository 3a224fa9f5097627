"""``python -m raycl.leaderboard``: a sweep's best trials from MLflow, as a table.

Trials are ranked by the sweep's objective (a validation metric); the test counterpart of the
objective and of every per-attribute probe stands beside it, reported, never used to rank. By
default the most recent sweep (parent run) of the experiment; ``--all`` ranks the trials of every
sweep in it. Under the table: chance on val, the untrained backbone's row ("at init", with
``eval.baseline``), how large a difference the val split resolves; a trial ASHA stopped shows
the winner's objective at the epoch it reached. The searched keys are always shown;
``--columns a,b``, ``--wide`` and ``--attributes`` (per-attribute probes) choose the rest.

A sweep that confirmed its best configurations over seeds (``tune.confirm``) leads with that
confirmed answer (:mod:`raycl.tracking.confirm_summary`): the parent's ``confirm.csv`` and its
verdict, and the trial ``--trial best`` names; the search's table follows.

The same table (:func:`raycl.tracking.trial_table.trial_table`) is what the sweep's callback
writes to its parent run after every trial: ``leaderboard.csv``, ``leaderboard.png`` and the
run's description. This module is the command only; the table lives in
:mod:`raycl.tracking.trial_table`.
"""

from __future__ import annotations

import argparse
import os
import sys

from raycl.config.sweep import add_tracking_uri_option, resolve_tracking_uri
from raycl.tracking.closed_stdout import reading_command
from raycl.tracking.confirm_summary import print_confirmed_answer
from raycl.tracking.retry import RETRY_ENV
from raycl.tracking.runs import ROLE_TAG, mlflow_client
from raycl.tracking.trial_table import ColumnChoice, print_leaderboard


def main(argv: list[str] | None = None) -> int:
    """``python -m raycl.leaderboard`` (and ``raycl-leaderboard``); returns the exit code. Piped
    into a reader that stops early (``| head``), it stops quietly."""
    return reading_command(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raycl.leaderboard",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", help="MLflow experiment (default: the most recent one)")
    parser.add_argument("--top", type=int, default=10, help="rows to show")
    parser.add_argument("--all", dest="all_sweeps", action="store_true",
                        help="rank trials of every sweep in the experiment")
    parser.add_argument("--columns", type=_column_list, default=None, metavar="A,B,C",
                        help="show these columns (besides the trial, its status, the objective "
                        "and the searched keys, always shown)")
    parser.add_argument("--wide", action="store_true",
                        help="every column, however wide the terminal")
    parser.add_argument("--attributes", action="store_true",
                        help="the per-attribute probe columns too (val/linear/<attribute>, "
                        "test/linear/<attribute>)")
    add_tracking_uri_option(parser)
    args = parser.parse_args(argv)
    # A person waiting at a terminal: a store that is away is said within seconds, not after
    # a sweep's five minutes of retries (raycl.tracking.retry); a value the user set is kept.
    os.environ.setdefault(RETRY_ENV, "10")
    experiment = args.experiment
    if experiment is None:
        client = mlflow_client(resolve_tracking_uri(args.tracking_uri))
        runs = client.search_runs(
            [e.experiment_id for e in client.search_experiments()],
            f"tags.`{ROLE_TAG}` = 'sweep'", order_by=["attributes.start_time DESC"],
            max_results=1)
        if not runs:
            print(f"error: no raycl sweep in {args.tracking_uri}", file=sys.stderr)
            return 2
        experiment = client.get_experiment(runs[0].info.experiment_id).name
    try:
        if not args.all_sweeps:  # the confirmed answer first: it, not the search, decides
            print_confirmed_answer(args.tracking_uri, experiment)
        print_leaderboard(args.tracking_uri, experiment, args.top, args.all_sweeps,
                          ColumnChoice(args.columns, args.wide, args.attributes))
    except (LookupError, ValueError) as exc:  # no such sweep; a --columns name it lacks
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _column_list(text: str) -> tuple[str, ...]:
    """``--columns a,b,c`` as its names, blanks dropped.

    Raises:
        argparse.ArgumentTypeError: no name in it.
    """
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected column names separated by commas")
    return names


if __name__ == "__main__":
    sys.exit(main())
