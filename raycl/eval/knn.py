"""Weighted cosine k-nearest-neighbour evaluation of frozen features."""

from __future__ import annotations

from collections.abc import Mapping

import faiss
import numpy as np
import torch

from raycl.eval.linear import ArrayLike, check_attributes, check_probe_inputs
from raycl.eval.queries import sample_queries
from raycl.eval.threads import exact_float32_matmul

# (query, train) pairs per block of the on-device search: a 512 MB similarity matrix at a time.
DEVICE_BLOCK_PAIRS = 1 << 27


def _unit_rows(features: np.ndarray) -> np.ndarray:
    data = np.ascontiguousarray(features, dtype=np.float32)
    norms = np.linalg.norm(data, axis=1, keepdims=True)
    return np.ascontiguousarray(data / np.maximum(norms, 1e-12))


def _device_neighbours(
    train_unit: np.ndarray, test_unit: np.ndarray, k: int, device: torch.device
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k inner products by blocked matrix products on ``device`` (a GPU: the CPU
    build of faiss cannot use it); memory O(block × N) beside the gallery."""
    gallery = torch.from_numpy(train_unit).to(device)
    rows = max(1, DEVICE_BLOCK_PAIRS // len(train_unit))
    similarities, neighbours = [], []
    with torch.no_grad(), exact_float32_matmul():
        for start in range(0, len(test_unit), rows):
            block = torch.from_numpy(test_unit[start:start + rows]).to(device)
            values, indices = torch.topk(block @ gallery.T, k, dim=1)
            similarities.append(values.cpu().numpy())
            neighbours.append(indices.cpu().numpy())
    return np.concatenate(similarities), np.concatenate(neighbours)


def knn_neighbours(
    train_x: np.ndarray, test_x: np.ndarray, k: int, device: torch.device | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Cosine similarities and indices of each test row's k nearest training rows (exact: every
    (test, train) pair is scored; tests count the pairs here).

    Args:
        train_x: (N, D) training features.
        test_x: (M, D) test features.
        k: neighbours per query, capped at N.
        device: a CUDA device searches there by blocked matrix products; otherwise faiss's
            brute-force search on the CPU (its threads: :mod:`raycl.eval.threads`).

    Returns:
        similarities (M, k') float32 and neighbour indices (M, k') int64, k' = min(k, N),
        most similar first.
    """
    k = min(k, train_x.shape[0])
    train_unit, test_unit = _unit_rows(train_x), _unit_rows(test_x)
    if device is not None and device.type == "cuda":
        return _device_neighbours(train_unit, test_unit, k, device)
    # faiss.knn searches without building an index: no second copy of the training rows.
    return faiss.knn(test_unit, train_unit, k, metric=faiss.METRIC_INNER_PRODUCT)


def weighted_vote(
    similarities: np.ndarray,
    neighbours: np.ndarray,
    train_y: np.ndarray,
    temperature: float,
) -> np.ndarray:
    """Predict labels by summing exp(sim / temperature) per class over the neighbours.

    Args:
        similarities: (M, k) cosine similarities.
        neighbours: (M, k) training indices.
        train_y: (N,) training labels.
        temperature: vote temperature (> 0).

    Returns:
        (M,) predicted labels (values from `train_y`).
    """
    classes, train_classes = np.unique(train_y, return_inverse=True)
    # Subtracting the row max keeps exp() finite for small temperatures; it scales every
    # vote of a query equally, so the argmax is unchanged.
    logits = similarities.astype(np.float64) / temperature
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    num_queries, num_neighbours = neighbours.shape
    scores = np.zeros((num_queries, len(classes)), dtype=np.float64)
    query_rows = np.repeat(np.arange(num_queries), num_neighbours)
    np.add.at(scores, (query_rows, train_classes[neighbours].reshape(-1)), weights.reshape(-1))
    return classes[scores.argmax(axis=1)]


def _check_knn_args(k: int, temperature: float) -> None:
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def knn_accuracy(
    train_x: ArrayLike,
    train_y: ArrayLike,
    test_x: ArrayLike,
    test_y: ArrayLike,
    k: int = 20,
    temperature: float = 0.07,
) -> float:
    """Top-1 accuracy of similarity-weighted kNN voting (InstDisc / solo-learn style).

    Each test point takes its k most cosine-similar training points (faiss IndexFlatIP on
    L2-normalised float32 rows); neighbour i adds exp(sim_i / temperature) to its class
    score, and the highest score wins.

    Args:
        train_x: (N, D) training features.
        train_y: (N,) integer labels.
        test_x: (M, D) test features.
        test_y: (M,) integer labels.
        k: neighbours per query (capped at N).
        temperature: vote temperature; small values approach "label of the nearest".

    Returns:
        Accuracy in [0, 1].
    """
    _check_knn_args(k, temperature)
    train_np, train_labels, test_np, test_labels = check_probe_inputs(
        train_x, train_y, test_x, test_y
    )
    similarities, neighbours = knn_neighbours(train_np, test_np, k)
    predictions = weighted_vote(similarities, neighbours, train_labels, temperature)
    return float(np.mean(predictions == test_labels))


def evaluate_knn(
    train_feats: ArrayLike,
    train_labels: Mapping[str, ArrayLike],
    test_feats: ArrayLike,
    test_labels: Mapping[str, ArrayLike],
    k: int = 20,
    temperature: float = 0.07,
    max_queries: int | None = None,
    seed: int = 0,
    device: torch.device | None = None,
) -> dict[str, float]:
    """kNN accuracy for every labelled attribute of a dataset (one neighbour search).

    Every test row is a query against every training row, or ``max_queries`` test rows drawn
    uniformly with ``seed`` (:func:`raycl.eval.queries.sample_queries`) when there are more:
    the accuracy is then the mean over the drawn queries.

    Args:
        train_feats: (N, D) training features.
        train_labels: attribute name -> (N,) integer labels.
        test_feats: (M, D) test features.
        test_labels: attribute name -> (M,) labels; same keys as `train_labels`.
        k: neighbours per query.
        temperature: vote temperature.
        max_queries: most test rows to score (None: every row).
        seed: seed of the query draw.
        device: where the search runs (see :func:`knn_neighbours`).

    Returns:
        {attribute: accuracy, ..., "mean": mean over attributes}.
    """
    _check_knn_args(k, temperature)
    attributes = check_attributes(train_labels, test_labels)
    checked = {
        attribute: check_probe_inputs(
            train_feats, train_labels[attribute], test_feats, test_labels[attribute]
        )
        for attribute in attributes
    }
    train_np, _, test_np, _ = checked[attributes[0]]
    queries = sample_queries(len(test_np), max_queries, seed)
    if len(queries) < len(test_np):
        test_np = test_np[queries]
    # Neighbours depend on features only, so search once and vote per attribute.
    similarities, neighbours = knn_neighbours(train_np, test_np, k, device)
    results: dict[str, float] = {}
    for attribute in attributes:
        _, train_y, _, test_y = checked[attribute]
        predictions = weighted_vote(similarities, neighbours, train_y, temperature)
        results[attribute] = float(np.mean(predictions == test_y[queries]))
    results["mean"] = float(np.mean([results[attribute] for attribute in attributes]))
    return results
