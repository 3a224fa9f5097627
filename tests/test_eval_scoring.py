"""Rank 0's scoring at scale (issue 33, finding 2): retrieval and kNN score (sampled queries ×
gallery) pairs, not N², with the exact metrics of the full gallery; the scoring runs with the
worker's reserved CPUs even where Ray set OMP_NUM_THREADS=1; the linear probe goes to torch at
scale without touching the caller's features."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score
from test_config import BASE, error_of  # one-line ConfigError of a YAML in tmp_path
from test_image_retrieval import TOY, TOY_LABELS, sklearn_map
from test_label_fractions import blob_features, blob_splits
from threadpoolctl import threadpool_info, threadpool_limits

import raycl.eval.image_retrieval as image_retrieval
import raycl.eval.knn as knn
import raycl.eval.scoring as scoring
from raycl.eval.knn import evaluate_knn, knn_accuracy
from raycl.eval.linear import torch_linear_probe_scores
from raycl.eval.queries import sample_queries
from raycl.kmeans import l2_normalize
from raycl.methods import SearchConfig


def make_config(**sections: Any) -> SearchConfig:
    return SearchConfig(name="t", method="simclr", **{"eval": {"linear_max_iter": 50},
                                                      **sections})


def count_pairs(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Spy on the two places that score (query, item) pairs; returns the running counts."""
    pairs = {"retrieval": 0, "knn": 0}
    block, neighbours = image_retrieval.similarity_block, knn.knn_neighbours

    def counted_block(queries: torch.Tensor, gallery: torch.Tensor) -> torch.Tensor:
        # IEEE float32 products even where training allowed TF32 (no reordered neighbours).
        assert torch.get_float32_matmul_precision() == "highest"
        pairs["retrieval"] += queries.shape[0] * gallery.shape[0]
        return block(queries, gallery)

    def counted_neighbours(train_x: np.ndarray, test_x: np.ndarray, k: int,
                           device: torch.device | None = None) -> tuple[np.ndarray, np.ndarray]:
        pairs["knn"] += train_x.shape[0] * test_x.shape[0]
        return neighbours(train_x, test_x, k, device)

    monkeypatch.setattr(image_retrieval, "similarity_block", counted_block)
    monkeypatch.setattr(knn, "knn_neighbours", counted_neighbours)
    return pairs


def test_scoring_counts_queries_times_gallery_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    data = blob_splits(num_train=200, num_eval=300)
    features = blob_features(data)
    pairs = count_pairs(monkeypatch)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # as raycl.worker.cuda sets it for training
    capped = make_config(eval={"linear_max_iter": 50, "retrieval_queries": 40,
                               "knn_queries": 25})
    try:
        metrics = scoring.evaluate_features(capped, data, features)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(precision)
    # val and test: 40 sampled queries against their whole split (not 300²), and 25 kNN queries
    # against the whole train split.
    assert pairs == {"retrieval": 2 * 40 * 300, "knn": 2 * 25 * 200}
    assert {f"val/retrieval/{name}" for name in ("rank1", "rank5", "map")} <= set(metrics)
    # Below the cap (the default 10 000) every row is a query: today's values, unchanged.
    pairs.update(retrieval=0, knn=0)
    full = scoring.evaluate_features(make_config(), data, features)
    assert pairs == {"retrieval": 2 * 300 * 300, "knn": 2 * 300 * 200}
    labels = data.val.labels["shape"]
    assert full["val/retrieval/map"] == pytest.approx(sklearn_map(features["val"], labels))


def test_sampled_retrieval_is_exact_over_the_full_gallery() -> None:
    # TOY by hand (tests/test_image_retrieval.py): each query's AP and whether its top item hits.
    by_hand_ap = np.array([5 / 6, 5 / 6, 9 / 14, 2 / 3, 9 / 14, 1.0, 1.0, 19 / 84])
    top1_hit = np.array([1, 1, 1, 0, 1, 1, 1, 0], dtype=float)
    queries = sample_queries(8, 3, seed=5)
    assert len(set(queries.tolist())) == 3
    scores = image_retrieval.retrieval_scores(TOY, TOY_LABELS, max_queries=3, seed=5,
                                              device=torch.device("cpu"))
    assert scores["rank1"] == pytest.approx(top1_hit[queries].mean())
    assert scores["map"] == pytest.approx(by_hand_ap[queries].mean())
    # A cap at or above the split changes nothing; small blocks change nothing.
    assert image_retrieval.retrieval_scores(TOY, TOY_LABELS, max_queries=8) == \
        image_retrieval.retrieval_scores(TOY, TOY_LABELS, query_chunk=3)
    # Random case: sklearn's AP over the whole rest of the split, for the sampled queries only.
    rng = np.random.default_rng(0)
    features, labels = rng.normal(size=(120, 8)), rng.integers(0, 4, size=120)
    sampled = sample_queries(120, 30, seed=2)
    scores = image_retrieval.retrieval_scores(features, labels, max_queries=30, seed=2)
    unit = l2_normalize(features)
    expected = []
    for query in sampled:
        others = np.delete(np.arange(120), query)
        expected.append(average_precision_score(labels[others] == labels[query],
                                                unit[others] @ unit[query]))
    assert scores["map"] == pytest.approx(np.mean(expected), abs=1e-9)


# Hand case: five unit training vectors; queries between them (cosines exact enough).
KNN_TRAIN = np.array([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
KNN_TRAIN_Y = np.array([0, 0, 1, 1, 2])
KNN_TEST = np.array([[0.8, 0.6], [-0.6, 0.8], [0.6, -0.8]])
KNN_TEST_Y = np.array([0, 1, 2])


def test_knn_by_hand_on_faiss_and_on_the_device_path() -> None:
    # Top 3 of query 2 (label 2): (0,-1) 0.8 label 2, (1,0) 0.6 and (0.6,0.8) -0.28 label 0:
    # sharp votes pick 2, flat votes pick 0 (two neighbours against one).
    assert knn_accuracy(KNN_TRAIN, KNN_TRAIN_Y, KNN_TEST, KNN_TEST_Y, k=3) == 1.0
    assert knn_accuracy(KNN_TRAIN, KNN_TRAIN_Y, KNN_TEST, KNN_TEST_Y, k=3,
                        temperature=1e6) == pytest.approx(2 / 3)
    train_unit = KNN_TRAIN.astype(np.float32)
    test_unit = KNN_TEST.astype(np.float32)
    faiss_sims, faiss_ids = knn.knn_neighbours(train_unit, test_unit, 3)
    # The blocked matrix-product search that a CUDA device runs, here on the CPU.
    sims, ids = knn._device_neighbours(train_unit, test_unit, 3, torch.device("cpu"))
    np.testing.assert_array_equal(ids, faiss_ids)
    np.testing.assert_allclose(sims, faiss_sims, atol=1e-6)
    np.testing.assert_array_equal(ids, [[1, 0, 2], [2, 3, 1], [4, 0, 1]])
    # Two sampled queries: the accuracy over those two.
    sampled = sample_queries(3, 2, seed=1)
    flat = evaluate_knn(KNN_TRAIN, {"y": KNN_TRAIN_Y}, KNN_TEST, {"y": KNN_TEST_Y}, k=3,
                        temperature=1e6, max_queries=2, seed=1)
    assert flat["y"] == pytest.approx(np.mean(sampled != 2))


def blas_threads() -> set[int]:
    return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}


def test_scoring_runs_on_the_reserved_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    # As inside a Ray worker: OMP_NUM_THREADS=1, every pool on one thread.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch_before, faiss_before = torch.get_num_threads(), faiss.omp_get_max_threads()
    seen: list[tuple[int, int, set[int]]] = []
    original = scoring.retrieval_scores

    def spy(*args: Any, **kwargs: Any) -> dict[str, float]:
        seen.append((faiss.omp_get_max_threads(), torch.get_num_threads(), blas_threads()))
        return original(*args, **kwargs)

    monkeypatch.setattr(scoring, "retrieval_scores", spy)
    data = blob_splits()
    try:
        with threadpool_limits(limits=1):
            torch.set_num_threads(1)
            faiss.omp_set_num_threads(1)
            scoring.evaluate_features(make_config(scaling={"cpus_per_worker": 3}), data,
                                      blob_features(data))
            # Put back after the scoring: training goes on as it was.
            assert (faiss.omp_get_max_threads(), torch.get_num_threads()) == (1, 1)
            assert blas_threads() == {1}
    finally:
        torch.set_num_threads(torch_before)
        faiss.omp_set_num_threads(faiss_before)
    assert seen == [(3, 3, {3}), (3, 3, {3})]  # val and test


def test_linear_probe_goes_to_torch_at_scale_and_leaves_features_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    backends: list[str] = []

    def probe(train: np.ndarray, labels: Any, eval_sets: Any, **kwargs: Any) -> dict:
        backends.append(kwargs["backend"])
        return {split: {"shape": 0.5, "parity": 0.5, "mean": 0.5} for split in eval_sets}

    monkeypatch.setattr(scoring, "evaluate_linear_splits", probe)
    for rows in (20_001, 120):
        data = blob_splits(num_train=rows)
        scoring.evaluate_features(make_config(), data, blob_features(data, dim=4))
    assert backends == ["torch", "sklearn"]
    # The torch probe standardises a copy: the caller's float32 features stay as they were.
    rng = np.random.default_rng(0)
    train = rng.normal(loc=3.0, size=(64, 4)).astype(np.float32)
    before = train.copy()
    labels = np.arange(64) % 2
    scores = torch_linear_probe_scores(train, labels, {"val": (train, labels)}, epochs=2,
                                       device="cpu")
    np.testing.assert_array_equal(train, before)
    assert 0.0 <= scores["val"] <= 1.0


@pytest.mark.parametrize("key", ["retrieval_queries", "knn_queries"])
def test_query_caps_are_validated(tmp_path: Path, key: str) -> None:
    message = error_of(tmp_path, BASE + f"eval: {{{key}: 0}}\n")
    assert message.startswith(f"{tmp_path / 'search.yaml'}: eval.{key}")
    assert make_config().eval.retrieval_queries == 10_000
    assert make_config().eval.knn_queries is None
