"""``python -m raycl.compare A B``: two finished sweeps compared on the same data.

Each side (an MLflow experiment's most recent sweep, or a sweep by name) is measured seed by
seed: its seed-confirmation winner's runs, else its seed repeats, else its best trial alone
(one value, said so). Paired by seed where the sides share seeds (the difference A − B, its
95 % t-interval and whether it separates them), unpaired otherwise, said with why. The
validation objective decides; its test counterpart is reported beside it. Two sweeps on
different data or with different objectives are refused (exit 2). The work is
:mod:`raycl.results.compare`'s; this module is the command only.
"""

from __future__ import annotations

import argparse
import os
import sys

from raycl.config.sweep import add_tracking_uri_option
from raycl.results.compare import CompareRefused, compare_sweeps, comparison_lines
from raycl.tracking.closed_stdout import reading_command
from raycl.tracking.retry import RETRY_ENV


def main(argv: list[str] | None = None) -> int:
    """``python -m raycl.compare`` (and ``raycl-compare``); returns the exit code: 0, 2 when
    refused (one line on stderr), 1 when the store is away."""
    parser = argparse.ArgumentParser(prog="python -m raycl.compare",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("first", metavar="EXP_A", help="sweep A: an MLflow experiment (its "
                        "most recent sweep) or a sweep's name")
    parser.add_argument("second", metavar="EXP_B", help="sweep B, the same way")
    parser.add_argument("--metric", default=None, help="the validation metric compared "
                        "(default: the sweeps' objective)")
    add_tracking_uri_option(parser)
    args = parser.parse_args(argv)
    # A person waiting at a terminal: a store that is away is said within seconds.
    os.environ.setdefault(RETRY_ENV, "10")

    def compare() -> int:
        try:
            lines = comparison_lines(compare_sweeps(args.tracking_uri, args.first, args.second,
                                                    args.metric))
        except CompareRefused as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print("\n".join(lines))
        return 0

    return reading_command(compare)


if __name__ == "__main__":
    sys.exit(main())
