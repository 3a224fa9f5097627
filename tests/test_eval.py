"""Tests for the evaluation probes: linear, kNN, spectrum."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raycl.eval import (
    effective_rank,
    evaluate_knn,
    evaluate_linear,
    knn_accuracy,
    linear_probe_accuracy,
    singular_values,
    torch_linear_probe_accuracy,
)


def _separable(num: int, num_classes: int = 4, dim: int = 16, seed: int = 0):
    """Class c sits around 5 * e_c plus small noise: linearly and cosine separable."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, size=num)
    features = 5.0 * np.eye(dim)[labels] + 0.3 * rng.standard_normal((num, dim))
    return features.astype(np.float32), labels


def _random(num: int, num_classes: int = 4, dim: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((num, dim)).astype(np.float32), rng.integers(0, num_classes, num)


def test_linear_probe_separable_is_perfect_and_random_is_chance() -> None:
    train_x, train_y = _separable(400, seed=0)
    test_x, test_y = _separable(200, seed=1)
    assert linear_probe_accuracy(train_x, train_y, test_x, test_y) == 1.0
    train_x, train_y = _random(400, seed=0)
    test_x, test_y = _random(1000, seed=1)
    assert abs(linear_probe_accuracy(train_x, train_y, test_x, test_y) - 0.25) < 0.07


def test_torch_linear_probe_matches_behaviour() -> None:
    train_x, train_y = _separable(400, seed=0)
    test_x, test_y = _separable(200, seed=1)
    # Mini-batch path (batch_size < N) with tensor inputs.
    accuracy = torch_linear_probe_accuracy(
        torch.as_tensor(train_x),
        torch.as_tensor(train_y),
        test_x,
        test_y,
        epochs=20,
        batch_size=128,
    )
    assert accuracy == 1.0
    train_x, train_y = _random(400, seed=0)
    test_x, test_y = _random(1000, seed=1)
    chance = torch_linear_probe_accuracy(train_x, train_y, test_x, test_y, epochs=50)
    assert abs(chance - 0.25) < 0.07
    assert chance == torch_linear_probe_accuracy(train_x, train_y, test_x, test_y, epochs=50)


def test_probes_map_arbitrary_label_values() -> None:
    train_x, train_y = _separable(300, num_classes=3, seed=0)
    test_x, test_y = _separable(100, num_classes=3, seed=1)
    values = np.array([7, -2, 40])
    assert linear_probe_accuracy(train_x, values[train_y], test_x, values[test_y]) == 1.0
    assert (
        torch_linear_probe_accuracy(train_x, values[train_y], test_x, values[test_y], epochs=50)
        == 1.0
    )
    assert knn_accuracy(train_x, values[train_y], test_x, values[test_y]) == 1.0


def test_knn_separable_is_perfect_and_random_is_chance() -> None:
    train_x, train_y = _separable(400, seed=0)
    test_x, test_y = _separable(200, seed=1)
    assert knn_accuracy(train_x, train_y, test_x, test_y, k=20) == 1.0
    train_x, train_y = _random(400, seed=0)
    test_x, test_y = _random(1000, seed=1)
    assert abs(knn_accuracy(train_x, train_y, test_x, test_y) - 0.25) < 0.07


def test_knn_weighted_vote_hand_case() -> None:
    # Query along +x. Neighbours: one class-1 point exactly on +x (sim 1), two class-0
    # points at 60 degrees (sim 0.5). Majority vote says 0; weighting exp(sim/T) with a
    # small T says 1, with a huge T (uniform weights) says 0.
    train_x = np.array([[1.0, 0.0], [0.5, np.sqrt(0.75)], [0.5, -np.sqrt(0.75)]])
    train_y = np.array([1, 0, 0])
    query, query_label = np.array([[2.0, 0.0]]), np.array([1])
    assert knn_accuracy(train_x, train_y, query, query_label, k=3, temperature=0.07) == 1.0
    assert knn_accuracy(train_x, train_y, query, query_label, k=3, temperature=1e6) == 0.0
    # k larger than the training set is capped, not an error.
    assert knn_accuracy(train_x, train_y, query, query_label, k=50, temperature=0.07) == 1.0


def test_evaluate_dicts_report_each_attribute_and_mean() -> None:
    train_x, train_y = _separable(400, seed=0)
    test_x, test_y = _separable(200, seed=1)
    rng = np.random.default_rng(2)
    train_labels = {"signal": train_y, "noise": rng.integers(0, 4, 400)}
    test_labels = {"signal": test_y, "noise": rng.integers(0, 4, 200)}
    for results in (
        evaluate_linear(train_x, train_labels, test_x, test_labels),
        evaluate_linear(train_x, train_labels, test_x, test_labels, max_iter=50, backend="torch"),
        evaluate_knn(train_x, train_labels, test_x, test_labels),
    ):
        assert list(results) == ["signal", "noise", "mean"]
        assert results["signal"] == 1.0
        assert results["noise"] < 0.5
        assert results["mean"] == pytest.approx((results["signal"] + results["noise"]) / 2)
    with pytest.raises(ValueError, match="attributes differ"):
        evaluate_knn(train_x, train_labels, test_x, {"signal": test_y})


def test_probe_validation() -> None:
    train_x, train_y = _separable(40, seed=0)
    with pytest.raises(ValueError, match="2-D"):
        linear_probe_accuracy(train_x[0], train_y, train_x, train_y)
    with pytest.raises(ValueError, match="labels"):
        knn_accuracy(train_x, train_y[:-1], train_x, train_y)
    with pytest.raises(ValueError, match="dims differ"):
        knn_accuracy(train_x, train_y, train_x[:, :3], train_y)
    with pytest.raises(ValueError, match="temperature"):
        knn_accuracy(train_x, train_y, train_x, train_y, temperature=0.0)


def test_effective_rank_isotropic_and_rank_one() -> None:
    rng = np.random.default_rng(0)
    dim = 32
    isotropic = rng.standard_normal((4000, dim))
    assert effective_rank(isotropic) == pytest.approx(dim, rel=0.02)
    rank_one = rng.standard_normal((500, 1)) @ rng.standard_normal((1, dim)) + 3.0
    assert effective_rank(rank_one) == pytest.approx(1.0, abs=1e-3)
    # Two equal directions -> exactly 2.
    two = np.concatenate([np.eye(2) * 1.0, -np.eye(2) * 1.0])
    assert effective_rank(two) == pytest.approx(2.0)
    assert effective_rank(np.ones((10, 4))) == 0.0  # collapsed to a point


def test_singular_values_of_centred_matrix() -> None:
    # Rows +-e_0 * 3 plus a constant offset: centring removes the offset, leaving one
    # singular value sqrt(2 * 9) = sqrt(18).
    data = np.array([[3.0, 0.0], [-3.0, 0.0]]) + np.array([10.0, 10.0])
    values = singular_values(data)
    np.testing.assert_allclose(values, [np.sqrt(18.0), 0.0], atol=1e-9)
    assert singular_values(data, center=False)[0] > 14.0


def test_one_probe_scores_validation_and_test() -> None:
    """Validation and test numbers come from the same fitted probe, split by split."""
    from raycl.eval import evaluate_linear_splits, linear_probe_scores

    train_x, train_y = _separable(400, seed=0)
    val_x, val_y = _separable(100, seed=1)
    noise_x, noise_y = _random(300, seed=2)
    scores = linear_probe_scores(train_x, train_y, {"val": (val_x, val_y),
                                                   "test": (noise_x, noise_y)})
    assert scores["val"] == 1.0 and scores["test"] < 0.5
    assert scores["test"] == linear_probe_accuracy(train_x, train_y, noise_x, noise_y)
    for backend in ("sklearn", "torch"):
        results = evaluate_linear_splits(
            train_x, {"signal": train_y}, {"val": (val_x, {"signal": val_y}),
                                           "test": (noise_x, {"signal": noise_y})},
            max_iter=50, backend=backend)
        assert list(results) == ["val", "test"]
        assert results["val"] == {"signal": 1.0, "mean": 1.0}
        assert results["test"]["signal"] < 0.5
    with pytest.raises(ValueError, match="attributes differ"):
        evaluate_linear_splits(train_x, {"signal": train_y}, {"val": (val_x, {"x": val_y})})
