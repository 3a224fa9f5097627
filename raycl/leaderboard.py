"""``python -m raycl.leaderboard``: a sweep's best trials from MLflow, as a table.

Trials are ranked by the sweep's objective (a validation metric); the test counterpart of the
objective and of every per-attribute probe stands beside it, reported, never used to rank. By
default the most recent sweep (parent run) of the experiment; ``--all`` ranks the trials of every
sweep in it.
"""

from __future__ import annotations

import argparse
import math
import re
import sys

from raycl.config import reported_test_metric, resolve_tracking_uri
from raycl.tracking import PARENT_TAG, ROLE_TAG, _client


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
    filter_string = f"tags.`{ROLE_TAG}` = 'trial'"
    if not all_sweeps:
        filter_string += f" and tags.`{PARENT_TAG}` = '{parents[0].info.run_id}'"
    children = client.search_runs([found.experiment_id], filter_string, max_results=5000)

    def score(run) -> float:
        value = run.data.metrics.get(metric, math.nan)
        if math.isnan(value):
            return math.inf
        return -value if mode == "max" else value

    children.sort(key=score)
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
    header = ["#", "trial", "status", metric, *([objective_test] if objective_test else []),
              *searched, *extra]
    rows = []
    for rank, run in enumerate(children[:top], start=1):
        values = _searched(run.data.tags.get("raycl.searched", ""))
        status = run.data.tags.get("raycl.ended", run.info.status.lower())
        rows.append([str(rank), run.info.run_name or run.info.run_id[:8], status,
                     _fmt(run.data.metrics.get(metric)),
                     *([_fmt(run.data.metrics.get(objective_test))] if objective_test else []),
                     *[_fmt(values.get(key)) for key in searched],
                     *[_fmt(run.data.metrics.get(key)) for key in extra]])
    title = (f"{experiment}: {len(children)} trial(s), best {top} by {metric} ({mode})"
             f"{'' if all_sweeps else ', latest sweep'}; test/, transfer/ and diag/ columns are "
             f"reported, not ranked on")
    return header, rows, title


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
    print(f"\nmlflow ui --backend-store-uri {resolve_tracking_uri(tracking_uri)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raycl.leaderboard",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", help="MLflow experiment (default: the most recent one)")
    parser.add_argument("--top", type=int, default=10, help="rows to show")
    parser.add_argument("--all", dest="all_sweeps", action="store_true",
                        help="rank trials of every sweep in the experiment")
    parser.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="MLflow URI")
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
