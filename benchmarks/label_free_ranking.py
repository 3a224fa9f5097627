"""How well the label-free figures rank a sweep's trials, measured once (issue 48).

Runs a SimCLR sweep on Trifeature (searches/quickstart.yaml, a wide random search over the
learning rate and τ, every trial to its last epoch: no scheduler) through ``python -m
raycl.tune``, then reads its trials from MLflow and reports, for each per-epoch figure (the
validation probe ``val/linear/mean`` itself, RankMe, α-ReQ, the normalised std, the training
loss) at 25 %, 50 % and 100 % of the budget:

- Kendall's τ between the trials' ranking by that figure then and their ranking by the final
  ``val/linear/mean`` (:func:`raycl.tracking.rung_agreement.agreement_rows`, the sweep's own
  ``rung_agreement.csv``);
- the regret of selecting the trial that figure puts first: the best final
  ``val/linear/mean`` minus the pick's (validation, what a sweep selects on), and the pick's
  ``test/linear/mean`` beside the probe-selected trial's (reported, never selected on).

``--cost`` times :func:`raycl.eval.label_free.label_free_scores` (the three figures of one
split) on random features of the default 4 096 rows at several widths.

    .venv/bin/python benchmarks/label_free_ranking.py --out /var/tmp/label_free --trials 12
    .venv/bin/python benchmarks/label_free_ranking.py --out /var/tmp/label_free --analyse-only
    .venv/bin/python benchmarks/label_free_ranking.py --cost

One JSON object on stdout, and a Markdown table on stderr.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
NAME = "label-free-ranking"
PROBE = "val/linear/mean"
FIGURES = {PROBE: "max", "val/label_free/rankme": "max", "val/label_free/alpha": "near_one",
           "val/label_free/std": "max", "train/loss": "min"}


def run_sweep(out: Path, trials: int, epochs: int, samples: int) -> None:
    """The sweep: quickstart's SimCLR, a wide random search, every trial to its end."""
    overrides = [
        f"data.samples_per_combination={samples}", f"train.epochs={epochs}",
        f"eval.every_n_epochs={max(1, epochs // 4)}", "tune.searcher=random",
        "tune.scheduler.type=none", "tune.max_concurrent_trials=2",
        "scaling.cpus_per_worker=1", "eval.diagnostics=false", "mlflow.log_encoder=false",
        "tune.search_space={simclr.temperature: {loguniform: [0.03, 1.0]}, "
        "train.lr: {loguniform: [0.0001, 0.02]}}"]
    command = [sys.executable, "-m", "raycl.tune", str(REPO / "searches" / "quickstart.yaml"),
               *[arg for item in overrides for arg in ("--set", item)],
               "--num-samples", str(trials), "--name", NAME, "--storage", str(out / "ray"),
               "--tracking-uri", f"sqlite:///{out / 'mlflow.db'}"]
    subprocess.run(command, check=True, cwd=out)


def _histories(out: Path) -> tuple[dict[str, dict[str, dict[int, float]]], dict[str, float],
                                   dict[str, float]]:
    """figure -> run id -> epoch -> value, the final val/linear/mean and test/linear/mean of
    every trial that ran to its end."""
    from mlflow import MlflowClient

    from raycl.tracking.runs import ROLE_TAG

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(NAME)
    assert experiment is not None, f"no experiment {NAME} in {out / 'mlflow.db'}"
    runs = [run for run in client.search_runs([experiment.experiment_id], max_results=1000)
            if run.data.tags.get(ROLE_TAG) == "trial" and run.info.status == "FINISHED"
            and PROBE in run.data.metrics]
    histories = {figure: {run.info.run_id: {int(m.step): float(m.value) for m in
                                            client.get_metric_history(run.info.run_id, figure)}
                          for run in runs} for figure in FIGURES}
    final = {run.info.run_id: run.data.metrics[PROBE] for run in runs}
    test = {run.info.run_id: run.data.metrics.get("test/linear/mean", float("nan"))
            for run in runs}
    return histories, final, test


def _goodness(value: float, direction: str) -> float:
    return -value if direction == "min" else -abs(value - 1.0) if direction == "near_one" \
        else value


def analyse(out: Path) -> dict[str, Any]:
    """τ and regret per figure at 25 %, 50 % and 100 % of the evaluated epochs."""
    from raycl.tracking.rung_agreement import agreement_rows

    histories, final, test = _histories(out)
    rows = agreement_rows(histories, final, FIGURES, "max")
    epochs = sorted({int(row["epoch"]) for row in rows if row["figure"] == PROBE})
    last = epochs[-1]
    marks = {"25%": round(last * 0.25), "50%": round(last * 0.5), "100%": last}
    best = max(final, key=final.__getitem__)
    table: dict[str, dict[str, Any]] = {}
    for figure, direction in FIGURES.items():
        for mark, epoch in marks.items():
            at = {run: values[epoch] for run, values in histories[figure].items()
                  if epoch in values and np.isfinite(values[epoch])}
            if not at:
                continue
            pick = max(at, key=lambda run, d=direction: _goodness(at[run], d))
            tau = next((float(row["kendall_tau"]) for row in rows
                        if row["figure"] == figure and int(row["epoch"]) == epoch), None)
            table.setdefault(figure, {})[mark] = {
                "epoch": epoch, "kendall_tau": tau,
                "regret_val_linear_mean": final[best] - final[pick],
                "pick_test_linear_mean": test[pick]}
    return {"trials": len(final), "epochs": last, "marks": marks,
            "best_val_linear_mean": final[best], "best_test_linear_mean": test[best],
            "val_linear_mean_range": [min(final.values()), max(final.values())],
            "figures": table}


def markdown(result: dict[str, Any]) -> str:
    marks = list(result["marks"])
    lines = ["| figure | " + " | ".join(f"τ at {m} | regret at {m}" for m in marks) + " |",
             "|---|" + "---|---|" * len(marks)]
    for figure, cells in result["figures"].items():
        parts = []
        for mark in marks:
            cell = cells.get(mark)
            tau = "–" if cell is None or cell["kendall_tau"] is None else \
                f"{cell['kendall_tau']:+.2f}"
            regret = "–" if cell is None else f"{cell['regret_val_linear_mean']:.3f}"
            parts += [tau, regret]
        lines.append(f"| `{figure}` | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def cost(rows: int = 4096, widths: tuple[int, ...] = (64, 128, 512, 2048)) -> dict[str, float]:
    """Seconds of :func:`label_free_scores` for one split of ``rows`` x width features (the
    median of 3)."""
    from raycl.eval.label_free import label_free_scores

    seconds: dict[str, float] = {}
    rng = np.random.default_rng(0)
    for width in widths:
        features = {"val": rng.standard_normal((rows, width)).astype(np.float32)}
        times = []
        for _ in range(3):
            started = time.perf_counter()
            label_free_scores(features, splits=("val",), max_rows=rows)
            times.append(time.perf_counter() - started)
        seconds[f"{rows}x{width}"] = float(np.median(times))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="the sweep's directory (storage, mlflow.db)")
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--samples", type=int, default=2,
                        help="data.samples_per_combination (x1000 images)")
    parser.add_argument("--analyse-only", action="store_true")
    parser.add_argument("--cost", action="store_true")
    args = parser.parse_args()
    if args.cost:
        print(json.dumps({"label_free_seconds": cost()}))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.analyse_only:
        run_sweep(args.out, args.trials, args.epochs, args.samples)
    result = analyse(args.out)
    print(json.dumps(result))
    print(markdown(result), file=sys.stderr)


if __name__ == "__main__":
    main()
