"""Evaluation at scale: what each rank of a W-rank world holds while raycl evaluates N rows.

Runs raycl's own evaluation (:func:`raycl.worker.evaluate.evaluate_epoch`: the embedding pass
and its gathering on rank 0, MCL's clustering between stages and the integration of the stages,
the linear probe, kNN and retrieval on the capped splits) for a two-stage MCL trial on
synthetic features, in a W-rank gloo world of spawned processes on the CPU. The images are row
indices (three bytes per row) and a stand-in method's ``embed`` turns each into its stored
feature (its class centroid plus a fixed per-row offset), so the figure is the evaluation's own
cost, not a network's.

Measured per rank: ``peak_extra_mb``, the peak resident memory of stage 1's last evaluation
(gathering, the integration of both stages, probe, kNN, retrieval, MCL's summary) above the
rank's RSS just before it (``VmHWM`` after resetting it through ``/proc/self/clear_refs``;
rank 0 then holds stage 0's features, the stages' integration needs them);
``peak_extra_mb_first_stage``, the same over stage 0's last evaluation and the clustering
between the stages, above the RSS before it; ``seconds``: both, the slowest rank's. A small
warm-up evaluation runs first (what a process loads once is not a cost per row). One JSON
line on stdout.

``--final`` measures the end of a single-stage trial instead: one last evaluation with the
diagnostics on (spectrum and principal angles of the test split) and the papers' probe
(``eval.linear_sgd``, ``--sgd-epochs`` passes, no augmentation: the images are row indices).
``rank0_seconds`` is the time rank 0 spends in the sections the other ranks wait for (its
scoring and diagnostics), ``max_other_rank_wait_seconds`` the longest another rank waits for
them (issue 46: the cluster idles for that long).

    .venv/bin/python benchmarks/eval_scale.py --rows 400000 --dim 128 --world 2
    .venv/bin/python benchmarks/eval_scale.py --rows 100000 --dim 512 --held-out 20000 \
        --classes 1000 --world 2 --final --sgd-epochs 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from raycl.data import DatasetSplits, ImageSet
from raycl.distributed import barrier_after
from raycl.eval.multimodal import EvalSets
from raycl.methods import SearchConfig
from raycl.methods.base import Method
from raycl.worker import evaluate as evaluate_module
from raycl.worker import linear_eval as linear_eval_module
from raycl.worker.evaluate import evaluate_epoch
from raycl.worker.loop import between_stages
from raycl.worker.perf import Clock
from raycl.worker.stage_integration import StageInputs

# Seconds each rank spent in the sections the others wait for (``body``) and waiting for them
# (``wait``): :func:`_timed_barrier`, in place of raycl's barrier_after.
BARRIER_SECONDS = {"body": 0.0, "wait": 0.0}


class StoredFeatures(Method):
    """A stand-in method: an image is a row index (three bytes), its feature the row's class
    centroid plus a fixed offset of the row (as if stored; nothing of size N is kept)."""

    def __init__(self, labels: np.ndarray, dim: int, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.backbone = nn.Identity()
        classes = int(labels.max()) + 1
        self.register_buffer("centroids", torch.randn(classes, dim, generator=generator))
        self.register_buffer("frequencies", torch.rand(dim, generator=generator) * 3 + 0.1)
        self.labels = torch.from_numpy(labels)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        digits = ((images[:, :, 0, 0] * 0.5 + 0.5) * 255).round().long()
        rows = digits[:, 0] * 65536 + digits[:, 1] * 256 + digits[:, 2]
        offset = torch.sin(rows[:, None].float() * self.frequencies)
        return self.centroids[self.labels[rows]] + 1.5 * offset


@dataclass
class BareSession:
    """What the evaluation asks of a Ray Train session: this process's rank, world, device."""

    rank: int
    world_size: int
    device: torch.device


def synthetic_data(rows: int, held_out: int, seed: int,
                   classes: int = 10) -> tuple[DatasetSplits, np.ndarray]:
    """``rows`` training and ``held_out`` val and test images (each image its global row index
    in three bytes), labelled with ``classes`` classes; and every row's label."""
    total = rows + 2 * held_out
    labels = np.random.default_rng(seed).integers(0, classes, total).astype(np.int64)
    labels[:classes] = np.arange(classes)  # every class present: the centroids' count
    index = np.arange(total, dtype=np.int64)
    images = np.stack([index >> 16, (index >> 8) & 255, index & 255], axis=1)
    images = images.astype(np.uint8).reshape(total, 3, 1, 1)

    def part(first: int, last: int) -> ImageSet:
        return ImageSet(images=images[first:last], labels={"label": labels[first:last]})

    data = DatasetSplits(name="synthetic", train=part(0, rows),
                         val=part(rows, rows + held_out), test=part(rows + held_out, total),
                         attributes=["label"], num_classes={"label": classes}, channels=3,
                         resolution=1)
    return data, labels


def trial_config(args: argparse.Namespace) -> Any:
    """A two-stage MCL trial (concatenated stages) with capped probe and held-out splits."""
    return SearchConfig.model_validate({
        "name": "eval-scale", "method": "mcl",
        "mcl": {"base": "simclr", "stages": 2, "clusters": 5, "kmeans_iterations": 10,
                "kmeans_max_points": 20_000},
        "eval": {"max_train_samples": args.max_train_samples,
                 "max_eval_samples": args.max_eval_samples, "linear_max_iter": 50,
                 "diagnostics": False},
        "scaling": {"num_workers": args.world, "cpus_per_worker": 1},
    })


def final_config(args: argparse.Namespace) -> Any:
    """A single-stage trial's end: capped probe, the diagnostics and the papers' probe."""
    return SearchConfig.model_validate({
        "name": "eval-scale-final", "method": "simclr",
        "eval": {"max_train_samples": args.max_train_samples,
                 "max_eval_samples": args.max_eval_samples, "linear_max_iter": 50,
                 "diagnostics": True,
                 "linear_sgd": {"epochs": args.sgd_epochs, "augment": False,
                                "lr_milestones": []}},
        "scaling": {"num_workers": args.world, "cpus_per_worker": 1},
    })


@contextmanager
def _timed_barrier(timeout: timedelta) -> Iterator[None]:
    """raycl's ``barrier_after``, timing its body and the wait after it (BARRIER_SECONDS)."""
    with barrier_after(timeout):
        started = time.perf_counter()
        yield
        BARRIER_SECONDS["body"] += time.perf_counter() - started
        waiting = time.perf_counter()
    BARRIER_SECONDS["wait"] += time.perf_counter() - waiting


def _status(field: str) -> float:
    """A ``/proc/self/status`` memory field, in MB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


@contextmanager
def _peak() -> Iterator[dict[str, float]]:
    """Measures the peak RSS above the RSS at entry, in MB (``["mb"]`` once the block ends):
    ``VmHWM`` after resetting it to the current RSS through ``/proc/self/clear_refs``."""
    measured: dict[str, float] = {}
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM := VmRSS
    yield measured
    measured["mb"] = _status("VmHWM") - before


def _rank(rank: int, args: argparse.Namespace, rendezvous: str, results: Any) -> None:
    """One rank: stage 0's last evaluation, the clustering, stage 1's last evaluation (or,
    with ``--final``, a single-stage trial's end)."""
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=args.world, timeout=timedelta(seconds=600))
    evaluate_module.barrier_after = _timed_barrier
    linear_eval_module.barrier_after = _timed_barrier
    if args.final:
        _final(rank, args, results)
        dist.destroy_process_group()
        return
    config = trial_config(args)
    session = BareSession(rank, args.world, torch.device("cpu"))
    # A small warm-up first: what is loaded once per process (sklearn, faiss, gloo's buffers)
    # is not the evaluation's cost per row.
    _two_stages(config, session, rows=2_000, held_out=200, dim=args.dim)
    data, labels = synthetic_data(args.rows, args.held_out, seed=0, classes=args.classes)
    methods = [StoredFeatures(labels, args.dim, seed=stage) for stage in range(2)]
    eval_sets = EvalSets(transfer=[], mmvp={})
    dist.barrier()
    BARRIER_SECONDS.update(body=0.0, wait=0.0)
    started = time.perf_counter()
    # Stage 0's last evaluation (gathering, probes) and the clustering between the stages ...
    with _peak() as first:
        features, metrics, _ = evaluate_epoch(config, data, eval_sets, StageInputs(),
                                              methods[0], session, last=True)
        inputs = between_stages(config, StageInputs(), features, metrics, None,
                                session, Clock(time.time()))
        del features
    # ... then stage 1's (gathering, the integration of both stages, probes, MCL's summary).
    with _peak() as second:
        _, metrics, diagnostics = evaluate_epoch(config, data, eval_sets, inputs, methods[1],
                                                 session, last=True)
    seconds = time.perf_counter() - started
    held = [len(f["train"]) for f in inputs.features if "train" in f]
    results.put({"rank": rank, "seconds": seconds,
                 "peak_extra_mb": second["mb"], "peak_extra_mb_first": first["mb"],
                 "train_rows_held": held, **BARRIER_SECONDS,
                 "val_linear": metrics.get("val/linear/mean"),
                 "mcl_summary": sorted(diagnostics or {})})
    dist.destroy_process_group()


def _final(rank: int, args: argparse.Namespace, results: Any) -> None:
    """One rank of ``--final``: a single-stage trial's last evaluation, diagnostics and the
    papers' probe included, after a small warm-up of the same."""
    config = final_config(args)
    session = BareSession(rank, args.world, torch.device("cpu"))
    eval_sets = EvalSets(transfer=[], mmvp={})
    warm_data, warm_labels = synthetic_data(2_000, 200, seed=1, classes=args.classes)
    evaluate_epoch(final_config(argparse.Namespace(**{**vars(args), "sgd_epochs": 1})),
                   warm_data, eval_sets, StageInputs(),
                   StoredFeatures(warm_labels, args.dim, seed=0), session, last=True)
    data, labels = synthetic_data(args.rows, args.held_out, seed=0, classes=args.classes)
    method = StoredFeatures(labels, args.dim, seed=0)
    dist.barrier()
    BARRIER_SECONDS.update(body=0.0, wait=0.0)
    started = time.perf_counter()
    with _peak() as peak:
        _, metrics, _ = evaluate_epoch(config, data, eval_sets, StageInputs(), method,
                                       session, last=True)
    results.put({"rank": rank, "seconds": time.perf_counter() - started,
                 "peak_extra_mb": peak["mb"], "peak_extra_mb_first": None,
                 "train_rows_held": [], **BARRIER_SECONDS,
                 "val_linear": metrics.get("val/linear/mean"),
                 "test_linear_sgd": metrics.get("test/linear_sgd/mean"),
                 "linear_sgd_seconds": metrics.get("perf/linear_sgd_seconds"),
                 "subclass_directions": metrics.get("diag/subclass_directions")})


def _two_stages(
    config: Any,
    session: BareSession,
    rows: int = 0,
    held_out: int = 0,
    dim: int = 0,
    data: DatasetSplits | None = None,
    methods: list[StoredFeatures] | None = None,
) -> tuple[StageInputs, dict[str, Any], dict[str, np.ndarray] | None]:
    """Stage 0's last evaluation, the clustering between the stages, stage 1's last evaluation
    (on ``data`` and ``methods``, or synthetic ones of ``rows``, ``held_out`` and ``dim``)."""
    if data is None or methods is None:
        data, labels = synthetic_data(rows, held_out, seed=1)
        methods = [StoredFeatures(labels, dim, seed=stage) for stage in range(2)]
    eval_sets = EvalSets(transfer=[], mmvp={})
    features, metrics, _ = evaluate_epoch(config, data, eval_sets, StageInputs(), methods[0],
                                          session, last=True)
    inputs = between_stages(config, StageInputs(), features, metrics, None,
                            session, Clock(time.time()))
    del features
    _, metrics, diagnostics = evaluate_epoch(config, data, eval_sets, inputs, methods[1],
                                             session, last=True)
    return inputs, metrics, diagnostics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=400_000, help="training rows N")
    parser.add_argument("--dim", type=int, default=128, help="feature width D")
    parser.add_argument("--world", type=int, default=2, help="ranks W (gloo, CPU)")
    parser.add_argument("--held-out", type=int, default=None,
                        help="rows of val and of test (default: N / 10)")
    parser.add_argument("--max-eval-samples", type=int, default=10_000)
    parser.add_argument("--max-train-samples", type=int, default=10_000)
    parser.add_argument("--classes", type=int, default=10, help="classes C of the labels")
    parser.add_argument("--final", action="store_true",
                        help="a single-stage trial's end: diagnostics and the papers' probe")
    parser.add_argument("--sgd-epochs", type=int, default=1,
                        help="with --final: eval.linear_sgd.epochs")
    args = parser.parse_args()
    args.held_out = args.held_out or max(10, args.rows // 10)
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="raycl-eval-scale-") as directory:
        processes = [context.Process(target=_rank, args=(
            rank, args, f"{directory}/rendezvous", results)) for rank in range(args.world)]
        for process in processes:
            process.start()
        ranks = sorted((results.get(timeout=1800) for _ in processes),
                       key=lambda result: result["rank"])
        for process in processes:
            process.join()
    array_mb = args.rows * args.dim * 4 / 2**20
    print(json.dumps({
        "rows": args.rows, "dim": args.dim, "world": args.world,
        "seconds": round(max(result["seconds"] for result in ranks), 2),
        "peak_extra_mb": [round(result["peak_extra_mb"], 1) for result in ranks],
        "peak_extra_mb_first_stage": [None if result["peak_extra_mb_first"] is None
                                      else round(result["peak_extra_mb_first"], 1)
                                      for result in ranks],
        "feature_array_mb": round(array_mb, 1),
        "held_out_rows": args.held_out, "max_eval_samples": args.max_eval_samples,
        "max_train_samples": args.max_train_samples,
        "classes": args.classes, "final": args.final,
        "rank0_seconds": round(ranks[0]["body"], 2),
        "max_other_rank_wait_seconds": round(max((result["wait"] for result in ranks[1:]),
                                                 default=0.0), 2),
        "val_linear_mean": ranks[0]["val_linear"],
        "train_rows_held_per_rank": [result["train_rows_held"] for result in ranks],
        **({key: ranks[0][key] for key in ("test_linear_sgd", "linear_sgd_seconds",
                                           "subclass_directions")} if args.final else {}),
    }))


if __name__ == "__main__":
    main()
