"""Time the support-set lookups of one NNCLR / All4One step: torch ``topk`` against faiss.

All4One looks up the k = 5 nearest queue entries for the momentum projections of *both* views
every step (2 lookups of B queries each; NNCLR: k = 1, 1 or 2 lookups). For each queue size Q
this measures, side by side in one process, the median time of one step's lookups (2 calls of
:func:`raycl.methods.queues.cosine_topk`, B queries each, D-wide L2-normalised float32 keys):

- ``torch``: matmul + ``topk`` on ``--device``;
- ``faiss``: ``faiss.knn`` exact inner product on the host. With ``--device cuda`` (no
  faiss-gpu needed) this includes copying the queue and the queries to the host and the results
  back, and is labelled so;
- ``queue``: what the method itself calls, :meth:`FeatureQueue.nearest` twice and
  :meth:`FeatureQueue.enqueue` once, with the default backend (torch).

The three are interleaved within each repeat (after ``--warmup`` untimed calls), so drift on a
shared machine hits all alike. Before timing, the two backends' neighbour sets are compared (the
fraction of equal top-k positions; ties aside they agree). With ``--steps-json`` (a
``benchmarks/method_steps.py`` result holding an ``all4one`` and/or ``nnclr`` step time) the
lookups are also given as a share of that step (All4One's for k > 1, NNCLR's for k = 1; a
symmetric NNCLR also looks up both views). Needs torch, numpy and faiss only (no Ray, no
MLflow: ``raycl.methods.queues`` imports nothing else):

    .venv/bin/python benchmarks/knn_lookup.py --steps-json benchmarks/method_steps_all4one.json \\
        --out benchmarks/knn_lookup.json                      # CPU, Q = 16k, 64k, 98k, k = 5
    .venv/bin/python benchmarks/knn_lookup.py --k 1 --out /tmp/knn_k1.json   # NNCLR's k = 1
    python benchmarks/knn_lookup.py --device cuda --out knn_lookup_cuda.json    # on a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from raycl.methods.queues import FeatureQueue, cosine_topk  # noqa: E402


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds one call of ``fn`` takes, synchronised on a GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def measure(size: int, args: argparse.Namespace) -> dict[str, Any]:
    """One queue size: agreement of the backends, then the interleaved timings (seconds)."""
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(size)
    keys = F.normalize(torch.randn(size, args.dim, generator=generator), dim=1).to(device)
    # The two views of a batch: B queries each (cosine_topk normalises them).
    views = [torch.randn(args.batch_size, args.dim, generator=generator).to(device)
             for _ in range(2)]
    index = torch.arange(args.batch_size, device=device)
    queue = FeatureQueue(size, args.dim).to(device)
    queue.embeddings.copy_(keys)

    _, torch_positions = cosine_topk(views[0], keys, args.k, "torch")
    _, faiss_positions = cosine_topk(views[0], keys, args.k, "faiss")
    agreement = (torch_positions.sort(dim=1).values
                 == faiss_positions.sort(dim=1).values).float().mean().item()

    def lookups(backend: str) -> Callable[[], object]:
        return lambda: [cosine_topk(view, keys, args.k, backend) for view in views]

    def queue_step() -> None:
        for view in views:
            queue.nearest(view, args.k)
        queue.enqueue(views[0], index)

    calls = {"torch": lookups("torch"), "faiss": lookups("faiss"), "queue": queue_step}
    for _ in range(args.warmup):
        for fn in calls.values():
            fn()
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.repeats):
        for name, fn in calls.items():
            seconds[name].append(timed(fn, device))
    return {"queue_size": size, "agreement": agreement, "seconds": seconds,
            "median_seconds": {name: statistics.median(values)
                               for name, values in seconds.items()}}


def step_seconds(path: str | None, method: str) -> dict[str, float]:
    """``{method: median step seconds}`` from a ``method_steps.py`` JSON, or {}."""
    if not path:
        return {}
    report = json.loads(Path(path).read_text())
    return {label: statistics.median(values) for label, values in report["seconds"].items()
            if label == method}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dim", type=int, default=256, help="embedding width D")
    parser.add_argument("--batch-size", type=int, default=256, help="queries per view")
    parser.add_argument("--k", type=int, default=5, help="neighbours per query (All4One: 5)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16_384, 65_536, 98_304],
                        help="queue sizes Q")
    parser.add_argument("--threads", type=int, default=2, help="torch and faiss (OpenMP) threads")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls of each first")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls of each")
    parser.add_argument("--steps-json", default=None,
                        help="method_steps.py result to express the lookups as a share of")
    parser.add_argument("--step-method", choices=("all4one", "nnclr"), default=None,
                        help="whose step (default: all4one for k > 1, nnclr for k = 1)")
    parser.add_argument("--out", default=None, help="write the raw numbers here (JSON)")
    args = parser.parse_args()
    import faiss

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    device = torch.device(args.device)
    faiss_label = "faiss (host copy included)" if device.type != "cpu" else "faiss"
    steps = step_seconds(args.steps_json,
                         args.step_method or ("all4one" if args.k > 1 else "nnclr"))

    print(f"one step's lookups: 2 x {args.batch_size} queries, D = {args.dim}, k = {args.k}, "
          f"{args.device}; median of {args.repeats} (ms)")
    header = (f"| queue size | torch | {faiss_label} | faiss speed-up | FeatureQueue step "
              f"(torch) | agreement |"
              + "".join(f" share of {label} step, torch / faiss |" for label in steps))
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    results = []
    for size in args.sizes:
        result = measure(size, args)
        median = result["median_seconds"]
        result["faiss_speedup"] = median["torch"] / median["faiss"]
        result["share_of_step"] = {label: {backend: median[backend] / seconds
                                           for backend in ("torch", "faiss")}
                                   for label, seconds in steps.items()}
        results.append(result)
        row = (f"| {size:,} | {1e3 * median['torch']:.1f} | {1e3 * median['faiss']:.1f} | "
               f"{result['faiss_speedup']:.2f}x | {1e3 * median['queue']:.1f} | "
               f"{result['agreement']:.4f} |")
        for shares in result["share_of_step"].values():
            row += f" {100 * shares['torch']:.1f}% / {100 * shares['faiss']:.1f}% |"
        print(row, flush=True)
    if args.out:
        settings = {**vars(args), "faiss_label": faiss_label,
                    "torch": torch.__version__, "faiss": faiss.__version__}
        Path(args.out).write_text(json.dumps(
            {"settings": settings, "step_seconds": steps, "results": results}, indent=2))


if __name__ == "__main__":
    main()
