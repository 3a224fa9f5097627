"""Wall time of one MCL trial (N stages) through Tune, in-process and with one Ray Train worker.

    .venv/bin/python benchmarks/mcl_trial.py [--stages 3] [--repeats 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def trial_seconds(stages: int, num_workers: int, epochs: int, samples: int) -> float:
    from raycl.launch.load import load_search
    from raycl.sweep.tuner import build_tuner

    root = Path(tempfile.mkdtemp(prefix="raycl-mcl-bench-"))
    config = load_search(REPO / "searches" / "mcl_k_n.yaml", [
        f"data.samples_per_combination={samples}", f"train.epochs={epochs}",
        f"mcl.stages={stages}", "mcl.clusters=2", "tune.search_space={}",
        "tune.num_samples=1", f"scaling.num_workers={num_workers}", "scaling.cpus_per_worker=2",
        f"tune.storage_path={root / 'ray'}", f"mlflow.tracking_uri=sqlite:///{root / 'm.db'}",
        f"name=mclbench{num_workers}"])
    started = time.perf_counter()
    results = build_tuner(config, None).fit()
    seconds = time.perf_counter() - started
    assert results[0].error is None, results[0].error
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples-per-combination", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    from raycl.sweep.local_ray import init_ray

    init_ray(num_cpus=4, log_to_driver=False)
    out: dict[str, list[float]] = {"in_process": [], "one_worker": []}
    for _ in range(args.repeats):
        for workers, key in ((0, "in_process"), (1, "one_worker")):
            out[key].append(trial_seconds(args.stages, workers, args.epochs,
                                          args.samples_per_combination))
            print(f"{key}: {out[key][-1]:.1f} s", flush=True)
    for key, values in out.items():
        print(f"MCL N={args.stages} trial, {key}: median {statistics.median(values):.1f} s "
              f"over {len(values)}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
