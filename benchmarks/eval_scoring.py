"""Time rank 0's retrieval and kNN scoring on synthetic features (issue 33, finding 2).

    python benchmarks/eval_scoring.py --rows 50000 --train-rows 100000 --dim 128 \\
        --queries 10000 --threads 2 [--device cuda]

prints one JSON line: the seconds of image retrieval on a ``--rows`` split (``--queries``
sampled queries against the whole split; 0: every row a query, N² pairs) and of kNN of those
rows against ``--train-rows`` training rows (``--knn-queries`` sampled; 0: every row), with
``--threads`` threads (:func:`raycl.eval.threads.scoring_threads`, as a worker that reserved
that many CPUs).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from raycl.eval.image_retrieval import retrieval_scores
from raycl.eval.knn import evaluate_knn
from raycl.eval.threads import scoring_threads


def synthetic(rows: int, dim: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian blobs, one per class, so the metrics are neither 0 nor 1."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, size=rows)
    centres = np.random.default_rng(0).normal(size=(classes, dim)).astype(np.float32)
    return centres[labels] + 2.0 * rng.normal(size=(rows, dim)).astype(np.float32), labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--train-rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--queries", type=int, default=10_000, help="0: every row")
    parser.add_argument("--knn-queries", type=int, default=0, help="0: every row")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip-knn", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    values, labels = synthetic(args.rows, args.dim, args.classes, seed=1)
    result: dict[str, object] = {"rows": args.rows, "dim": args.dim, "queries": args.queries,
                                 "threads": args.threads, "device": args.device}
    with scoring_threads(args.threads):
        start = time.perf_counter()
        result["retrieval"] = retrieval_scores(values, labels, max_queries=args.queries or None,
                                               device=device)
        result["retrieval_seconds"] = round(time.perf_counter() - start, 2)
        if not args.skip_knn:
            train, train_labels = synthetic(args.train_rows, args.dim, args.classes, seed=2)
            start = time.perf_counter()
            result["knn"] = evaluate_knn(train, {"y": train_labels}, values, {"y": labels},
                                         max_queries=args.knn_queries or None, device=device)
            result["knn_seconds"] = round(time.perf_counter() - start, 2)
            result.update(train_rows=args.train_rows, knn_queries=args.knn_queries)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
