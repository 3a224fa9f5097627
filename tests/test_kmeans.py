"""Tests for raycl.kmeans: k-means, pseudo-label codes, AMI matrix, stage budget."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import faiss
import numpy as np
import pytest
import torch
from sklearn.metrics import adjusted_mutual_info_score

from raycl.kmeans import (
    ami_matrix,
    check_stage_budget,
    group_size_histogram,
    group_sizes,
    kmeans,
    kmeans_gpu,
    pseudo_label_codes,
)


def _blobs(num_per_blob: int = 60, dim: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Four tight blobs along distinct directions (separable by cosine too)."""
    rng = np.random.default_rng(seed)
    centers = np.eye(dim)[:4] * 10.0
    labels = np.repeat(np.arange(4), num_per_blob)
    points = centers[labels] + 0.1 * rng.standard_normal((len(labels), dim))
    order = rng.permutation(len(labels))
    return points[order], labels[order]


def test_pseudo_label_codes_hand_computed() -> None:
    # K=3, sample 0 has (y0, y1) = (0, 1) -> 0*3 + 1 = 1; sample 1 has (2, 0) -> 2*3 + 0 = 6.
    codes = pseudo_label_codes([np.array([0, 2]), np.array([1, 0])], k=3)
    assert codes.tolist() == [1, 6]
    assert codes.dtype == np.int64


def test_pseudo_label_codes_encode_every_stage() -> None:
    # Samples 0 and 1 differ only in stage 0. The authors' slip (encoding only the latest
    # stage) would give them the same code; the paper's tuple label separates them.
    stage0 = np.array([0, 1, 1])
    stage1 = np.array([2, 2, 2])
    codes = pseudo_label_codes([stage0, stage1], k=3)
    assert codes[0] != codes[1]
    assert codes.tolist() == [2, 5, 5]
    # Three stages: code is a bijection of the tuple.
    rng = np.random.default_rng(0)
    stages = [rng.integers(0, 4, size=500) for _ in range(3)]
    codes = pseudo_label_codes(stages, k=4)
    tuples = {tuple(int(stage[i]) for stage in stages) for i in range(500)}
    assert len(np.unique(codes)) == len(tuples)
    decoded = np.stack([codes // 16, (codes // 4) % 4, codes % 4])
    np.testing.assert_array_equal(decoded, np.stack(stages))


def test_pseudo_label_codes_stage0_and_validation() -> None:
    np.testing.assert_array_equal(pseudo_label_codes([], k=5, num_samples=4), np.zeros(4))
    with pytest.raises(ValueError, match="num_samples"):
        pseudo_label_codes([], k=5)
    with pytest.raises(ValueError, match="outside"):
        pseudo_label_codes([np.array([0, 3])], k=3)
    with pytest.raises(ValueError, match="length"):
        pseudo_label_codes([np.array([0, 1]), np.array([0, 1, 2])], k=3)
    with pytest.raises(ValueError, match="int64"):
        pseudo_label_codes([np.zeros(2, dtype=np.int64)] * 64, k=2)


def test_group_sizes_and_histogram() -> None:
    codes = np.array([6, 1, 6, 6, 3])
    assert group_sizes(codes) == {1: 1, 3: 1, 6: 3}
    assert group_size_histogram(codes).tolist() == [3, 1, 1]


def test_kmeans_recovers_blobs_and_is_deterministic() -> None:
    points, labels = _blobs()
    assignments = kmeans(points, k=4, seed=3)
    assert assignments.dtype == np.int64
    assert assignments.shape == labels.shape
    assert set(assignments.tolist()) <= {0, 1, 2, 3}
    assert adjusted_mutual_info_score(labels, assignments) > 0.99
    np.testing.assert_array_equal(assignments, kmeans(points, k=4, seed=3))
    # Un-normalised path works too on these blobs.
    assert adjusted_mutual_info_score(labels, kmeans(points, k=4, seed=3, normalize=False)) > 0.99


def test_kmeans_normalize_clusters_by_direction() -> None:
    # Two directions, each at two very different scales: by L2 distance the scale
    # dominates, by direction (normalize=True, as the MCL authors) the direction does.
    rng = np.random.default_rng(0)
    direction = np.repeat([0, 1], 40)
    scale = np.tile(np.repeat([1.0, 100.0], 20), 2)
    points = np.eye(2)[direction] * scale[:, None] + 0.01 * rng.standard_normal((80, 2))
    assert adjusted_mutual_info_score(direction, kmeans(points, k=2, seed=0)) > 0.99


def test_kmeans_validates() -> None:
    points, _ = _blobs(num_per_blob=2)
    with pytest.raises(ValueError, match="k must"):
        kmeans(points, k=0, seed=0)
    with pytest.raises(ValueError, match="k must"):
        kmeans(points, k=len(points) + 1, seed=0)
    with pytest.raises(ValueError, match="2-D"):
        kmeans(points[0], k=1, seed=0)
    assert kmeans(points, k=len(points), seed=0).shape == (len(points),)


@pytest.mark.skipif(faiss.get_num_gpus() > 0, reason="checks the no-GPU error path")
def test_kmeans_on_a_gpu_faiss_cannot_use_is_a_clear_error() -> None:
    points, _ = _blobs(num_per_blob=2)
    with pytest.raises(ValueError, match="GPU"):
        kmeans(points, k=2, seed=0, gpu=0)
    assert kmeans(points, k=2, seed=0, gpu=None).shape == (len(points),)


def test_ami_matrix_symmetric_unit_diagonal() -> None:
    rng = np.random.default_rng(0)
    first = rng.integers(0, 3, size=300)
    relabelled = (first + 1) % 3  # same partition, different names
    independent = rng.integers(0, 3, size=300)
    matrix = ami_matrix([first, relabelled, independent])
    assert matrix.shape == (3, 3)
    np.testing.assert_allclose(matrix, matrix.T)
    np.testing.assert_allclose(np.diag(matrix), 1.0)
    assert matrix[0, 1] == pytest.approx(1.0)
    assert abs(matrix[0, 2]) < 0.05


def test_check_stage_budget() -> None:
    # Enforced form: K^(N-1) <= M/b. K=5, N=3 -> 25 groups; M/b = 1000/40 = 25: fits.
    assert check_stage_budget(k=5, stages=3, num_samples=1000, batch_size=40) is None
    problem = check_stage_budget(k=5, stages=3, num_samples=1000, batch_size=41)
    assert problem is not None and "25" in problem
    # A single stage has one group: only needs one batch.
    assert check_stage_budget(k=100, stages=1, num_samples=64, batch_size=64) is None
    assert check_stage_budget(k=2, stages=1, num_samples=63, batch_size=64) is not None
    # Paper's literal K^N <= M/b is K times stricter.
    assert check_stage_budget(5, 3, 1000, 40, count_final_clustering=True) is not None
    assert check_stage_budget(5, 3, 1000, 8, count_final_clustering=True) is None
    # The paper's own CLIP setting (K=10, 4 stages, b=8192, CC12M ~1e7 pairs) passes.
    assert check_stage_budget(10, 4, 10_000_000, 8192) is None
    with pytest.raises(ValueError):
        check_stage_budget(k=0, stages=3, num_samples=10, batch_size=2)


def test_kmeans_fits_on_every_point_unless_capped() -> None:
    """faiss's default fits on 256 points per centroid (512 of 4 000 for K=2); ours fits on all
    of them, so each centroid is the mean of every point assigned to it (Lloyd's fixed point)."""
    from raycl.kmeans import fit_kmeans, l2_normalize

    rng = np.random.default_rng(0)
    data = l2_normalize(np.concatenate([rng.normal(0, 1, (2000, 8)) + 3,
                                        rng.normal(0, 1, (2000, 8)) - 3]))

    def centroid_error(max_points: int | None) -> float:
        clustering = fit_kmeans(data, 2, seed=0, niter=50, max_points=max_points)
        _, assigned = clustering.index.search(data, 1)
        means = np.stack([data[assigned.ravel() == c].mean(axis=0) for c in range(2)])
        return float(np.abs(clustering.centroids - means).max())

    assert centroid_error(None) < 1e-5
    assert centroid_error(512) > 1e-3  # fitted on a subset: off the full-data means
    with pytest.raises(ValueError, match="max_points"):
        kmeans(data, 4, seed=0, max_points=3)


# ---------------------------------------------------------------------------------------------
# Which GPU k-means takes (issue 25, finding 3): only the one the calling process holds


@pytest.fixture
def four_faiss_gpus(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """faiss "sees" four GPUs; every Kmeans built records its ``gpu`` argument."""
    built: list[dict[str, Any]] = []

    class Recording(faiss.Kmeans):
        def __init__(self, d: int, k: int, **kwargs: Any) -> None:
            built.append(kwargs)
            super().__init__(d, k, **{**kwargs, "gpu": False})  # faiss-cpu: run on the CPU

    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 4)
    monkeypatch.setattr(faiss, "Kmeans", Recording)
    return built


def test_kmeans_stays_on_the_cpu_in_a_process_that_holds_no_gpu(four_faiss_gpus) -> None:
    """faiss seeing GPUs is not a process holding one: the trial process (no GPU reserved) and
    a CPU worker cluster on the CPU, where "GPU if faiss sees one" took every GPU of the node."""
    points, labels = _blobs()
    assert kmeans_gpu(None) is None and kmeans_gpu(torch.device("cpu")) is None
    assignments = kmeans(points, k=4, seed=3)
    assert [kwargs["gpu"] for kwargs in four_faiss_gpus] == [False]
    assert adjusted_mutual_info_score(labels, assignments) > 0.99


def test_kmeans_runs_on_the_one_gpu_the_worker_holds(four_faiss_gpus, monkeypatch) -> None:
    """A worker on cuda:2 clusters on GPU 2 alone (not faiss's "first n GPUs"), after PyTorch's
    cached blocks went back to the driver. The GPU index is faked: the path runs on the CPU."""
    calls: list[str] = []
    placed: list[list[int]] = []

    def to_gpus(index: faiss.Index, gpus: list[int]) -> faiss.Index:
        placed.append(list(gpus))
        return index

    monkeypatch.setattr(faiss, "index_cpu_to_gpus_list", to_gpus)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "device", lambda index: nullcontext(calls.append(index)))
    assert kmeans_gpu(torch.device("cuda", 2)) == 2
    points, _ = _blobs()
    assignments = kmeans(points, k=4, seed=3, gpu=kmeans_gpu(torch.device("cuda", 2)))
    assert placed == [[2]] and calls == ["empty_cache", 2]
    assert [kwargs["gpu"] for kwargs in four_faiss_gpus] == [False]
    np.testing.assert_array_equal(assignments, kmeans(points, k=4, seed=3))


def test_mcl_clusters_on_the_gpu_of_the_session_that_calls(monkeypatch) -> None:
    """Between stages rank 0 clusters on its own device; the trial process (no device) on the
    CPU."""
    from raycl.methods import SearchConfig
    from raycl.worker import stage_integration as stages

    seen: list[int | None] = []
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 4)
    monkeypatch.setattr(stages, "kmeans", lambda *args, gpu, **kwargs: seen.append(gpu))
    config = SearchConfig(name="t", method="mcl")
    features = {"train": np.zeros((8, 4), dtype=np.float32)}
    stages.cluster_stage(config, stages.StageInputs(), features, torch.device("cuda", 1))
    stages.cluster_stage(config, stages.StageInputs(), features, torch.device("cpu"))
    stages.cluster_stage(config, stages.StageInputs(), features)
    assert seen == [1, None, None]
