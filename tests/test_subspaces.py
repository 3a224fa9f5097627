"""Tests for the HSCL principal-angle diagnostic (shared vs subclass features)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from raycl.eval.subspaces import (
    AngleSummary,
    class_principal_angles,
    energy_basis,
    plot_angle_histogram,
    principal_angles,
    summarize_angles,
)


def _random_orthogonal(dim: int, seed: int) -> np.ndarray:
    q, r = np.linalg.qr(np.random.default_rng(seed).standard_normal((dim, dim)))
    return q * np.sign(np.diag(r))


@pytest.mark.parametrize("degrees", [1e-3, 0.5, 17.0, 45.0, 63.0, 89.9])
def test_planes_in_r3_with_known_angle(degrees: float) -> None:
    t = math.radians(degrees)
    eye = np.eye(3)
    a = eye[:, :2]
    b = np.stack([eye[:, 0], math.cos(t) * eye[:, 1] + math.sin(t) * eye[:, 2]], axis=1)
    np.testing.assert_allclose(principal_angles(a, b), [0.0, degrees], atol=1e-6)
    np.testing.assert_allclose(principal_angles(b, a), [0.0, degrees], atol=1e-6)


def test_planes_in_r4_two_nonzero_angles_and_rotation_invariance() -> None:
    s, t = math.radians(20.0), math.radians(70.0)
    eye = np.eye(4)
    a = eye[:, :2]
    b = np.stack(
        [
            math.cos(s) * eye[:, 0] + math.sin(s) * eye[:, 2],
            math.cos(t) * eye[:, 1] + math.sin(t) * eye[:, 3],
        ],
        axis=1,
    )
    np.testing.assert_allclose(principal_angles(a, b), [20.0, 70.0], atol=1e-6)
    rotation = _random_orthogonal(4, seed=3)
    np.testing.assert_allclose(
        principal_angles(rotation @ a, rotation @ b), [20.0, 70.0], atol=1e-6
    )
    # A line against a plane: one angle, the smallest one.
    np.testing.assert_allclose(principal_angles(b[:, 1:], a), [70.0], atol=1e-6)


def test_identical_subspaces_give_zeros_and_orthogonal_give_nineties() -> None:
    rotation = _random_orthogonal(6, seed=0)
    basis = rotation[:, :3]
    mixed = basis @ _random_orthogonal(3, seed=1)  # same span, different basis
    np.testing.assert_allclose(principal_angles(basis, mixed), np.zeros(3), atol=1e-6)
    np.testing.assert_allclose(principal_angles(basis, rotation[:, 3:]), [90.0] * 3, atol=1e-6)
    assert principal_angles(basis, np.zeros((6, 0))).shape == (0,)


def test_principal_angles_rejects_bad_bases() -> None:
    with pytest.raises(ValueError, match="row counts"):
        principal_angles(np.eye(3)[:, :2], np.eye(4)[:, :2])
    with pytest.raises(ValueError, match="orthonormal"):
        principal_angles(2.0 * np.eye(3)[:, :2], np.eye(3)[:, :2])


def _with_singular_values(values: list[float], rows: int, cols: int, seed: int) -> np.ndarray:
    left = _random_orthogonal(rows, seed)[:, : len(values)]
    right = _random_orthogonal(cols, seed + 1)[:, : len(values)]
    return left @ np.diag(values) @ right.T


def test_energy_basis_cut_and_orthonormality() -> None:
    matrix = _with_singular_values([10.0, 1.0, 0.01], rows=6, cols=5, seed=0)
    # 100 / 101.0001 = 0.9901 <= 0.995 < 101 / 101.0001 = 0.999999: two columns.
    basis = energy_basis(matrix, 0.995)
    assert basis.shape == (6, 2)
    np.testing.assert_allclose(basis.T @ basis, np.eye(2), atol=1e-10)
    assert energy_basis(matrix, 0.99).shape == (6, 1)
    assert energy_basis(matrix, 1.0).shape == (6, 3)  # whole numerical rank, not 5
    # The cut is strict (ratio > energy): an exact half of the energy is not enough.
    assert energy_basis(np.eye(4)[:, :2], 0.5).shape == (4, 2)
    # The basis spans the top-2 left singular directions of the matrix.
    expected = _random_orthogonal(6, 0)[:, :2]
    np.testing.assert_allclose(principal_angles(basis, expected), [0.0, 0.0], atol=1e-6)


def test_energy_basis_zero_matrix_and_errors() -> None:
    assert energy_basis(np.zeros((5, 4))).shape == (5, 0)
    for energy in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="energy"):
            energy_basis(np.eye(3), energy)
    with pytest.raises(ValueError, match="2-D"):
        energy_basis(np.ones(3))
    with pytest.raises(ValueError, match="NaN"):
        energy_basis(np.array([[1.0, np.nan], [0.0, 1.0]]))


def _structured(per_class: int = 60, noise: float = 0.0, seed: int = 0):
    """D=8, class c = 5 e_c + a e3 (shared) + b e_{4+c} (private), a and b zero-mean per class.

    Zero-mean coefficients keep the class centres exactly at 5 e_c, so after removing the
    centres class c spans {e3, e_{4+c}} and the others span e3 plus their private axes.
    """
    rng = np.random.default_rng(seed)
    eye = np.eye(8)
    blocks, labels = [], []
    for c in range(3):
        shared, private = rng.standard_normal((2, per_class))
        shared -= shared.mean()
        private -= private.mean()
        block = 5.0 * eye[c] + np.outer(shared, eye[3]) + np.outer(private, eye[4 + c])
        blocks.append(block + noise * rng.standard_normal(block.shape))
        labels.append(np.full(per_class, c))
    return np.concatenate(blocks), np.concatenate(labels)


@pytest.mark.parametrize("noise", [0.0, 1e-3])
def test_class_angles_recover_shared_and_private_directions(noise: float) -> None:
    features, labels = _structured(noise=noise)
    per_class = class_principal_angles(features, labels)
    assert sorted(per_class) == [0, 1, 2]
    for angles in per_class.values():
        # Two angles, not three: the centre directions e0..e2 were projected out (else
        # each class would span its own centre too), and the energy cut drops the noise.
        assert angles.shape == (2,)
        np.testing.assert_allclose(angles, [0.0, 90.0], atol=1e-6 if noise == 0 else 1.0)
    summary = summarize_angles(per_class)
    assert (summary.shared, summary.subclass, summary.classes) == (1.0, 1.0, 3)
    assert summary.angles.shape == (6,)


def test_class_angles_torch_input_and_extra_private_axis() -> None:
    """Class 0 also varies along e7 (zero-mean, so its centre stays put): one more 90."""
    features, labels = _structured()
    features[labels == 0, 7] += np.where(np.arange(60) % 2 == 0, 1.0, -1.0)
    angles = class_principal_angles(torch.from_numpy(features), torch.from_numpy(labels))
    np.testing.assert_allclose(angles[0], [0.0, 90.0, 90.0], atol=1e-6)  # {e3,e4,e7}
    np.testing.assert_allclose(angles[1], [0.0, 90.0], atol=1e-6)  # {e3,e5} vs 4-D rest


def test_class_angles_rank_deficient_centres_and_degenerate_classes() -> None:
    features, labels = _structured()
    eye = np.eye(8)
    # Class 3 is centred at 5 (e0 + e1), inside the span of the other centres, and varies
    # only along e3. Class 4 sits exactly on its centre 5 e2 (nothing left after the
    # projection); class 5 has one sample, 5 e0, and is skipped. Centres have rank 3 of 6.
    coefficients = np.random.default_rng(5).standard_normal(40)
    coefficients -= coefficients.mean()
    extra = 5.0 * (eye[0] + eye[1]) + np.outer(coefficients, eye[3])
    features = np.concatenate([features, extra, 5.0 * eye[[2, 2]], 5.0 * eye[[0]]])
    labels = np.concatenate([labels, np.full(40, 3), [4, 4], [5]])
    per_class = class_principal_angles(features, labels)
    assert sorted(per_class) == [0, 1, 2, 3, 4]
    for c in range(3):
        np.testing.assert_allclose(per_class[c], [0.0, 90.0], atol=1e-6)
    np.testing.assert_allclose(per_class[3], [0.0], atol=1e-6)  # e3 is shared by all
    assert per_class[4].shape == (0,)
    assert class_principal_angles(features[labels == 0], labels[labels == 0]) == {}


def test_class_angles_rejects_bad_inputs() -> None:
    features, labels = _structured()
    with pytest.raises(ValueError, match="labels"):
        class_principal_angles(features, labels[:-1])
    with pytest.raises(ValueError, match="labels"):
        class_principal_angles(features, labels.astype(np.float64))
    with pytest.raises(ValueError, match="energy"):
        class_principal_angles(features, labels, energy=0.0)
    features[0, 0] = np.inf
    with pytest.raises(ValueError, match="NaN or inf"):
        class_principal_angles(features, labels)


def test_summarize_angles_thresholds() -> None:
    per_class = {0: np.array([0.0, 9.9, 10.0, 45.0, 80.0, 80.1]), 1: np.array([5.0, 89.0])}
    summary = summarize_angles(per_class)
    assert summary.shared == pytest.approx((2 + 1) / 2)  # 10.0 itself is not below 10
    assert summary.subclass == pytest.approx((1 + 1) / 2)  # 80.0 itself is not above 80
    assert summary.classes == 2 and summary.angles.shape == (8,)
    wide = summarize_angles(per_class, shared_below=50.0, subclass_above=60.0)
    assert (wide.shared, wide.subclass) == (2.5, 1.5)
    empty = summarize_angles({})
    assert empty.classes == 0 and math.isnan(empty.shared)
    for low, high in ((-1.0, 80.0), (10.0, 91.0), (40.0, 40.0), (50.0, 20.0)):
        with pytest.raises(ValueError, match="shared_below"):
            summarize_angles(per_class, low, high)


def test_plot_angle_histogram_writes_png(tmp_path: Path) -> None:
    summary = AngleSummary(1.0, 1.0, np.array([0.5, 3.0, 88.0, 89.5, 45.0]), 2)
    path = tmp_path / "angles.png"
    plot_angle_histogram(summary, path, "test")
    assert path.stat().st_size > 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
