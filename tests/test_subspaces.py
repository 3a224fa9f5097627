"""Tests for the HSCL principal-angle diagnostic (shared vs subclass features)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from raycl.eval import subspaces
from raycl.eval.subspaces import (
    MAX_CLASSES,
    AngleSummary,
    class_principal_angles,
    diagnosed_classes,
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


# The per-class computation as it was (and as appendix C.2 writes it): an SVD of each class's
# and of each rest's (D, n) matrix of projections, for every class: N D^2 work per class. The
# reference the Gram-based version must agree with.


def _reference_floor(data: np.ndarray) -> float:
    return float(np.linalg.norm(data, ord=2) * max(data.shape) * np.finfo(np.float64).eps)


def _reference_basis(matrix: np.ndarray, energy: float, floor: float) -> np.ndarray:
    if matrix.shape[1] > matrix.shape[0]:
        matrix = np.linalg.qr(matrix.T, mode="r").T
    left, values, _ = np.linalg.svd(matrix, full_matrices=False)
    values = values[values > floor]
    if values.size == 0:
        return np.zeros((matrix.shape[0], 0))
    ratios = np.cumsum(values**2) / np.sum(values**2)
    return left[:, : min(int(np.sum(ratios <= energy)) + 1, values.size)]


def _reference_angles(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.shape[1] < b.shape[1]:
        a, b = b, a
    if b.shape[1] == 0:
        return np.zeros(0)
    cosines = np.clip(np.linalg.svd(a.T @ b, compute_uv=False), 0.0, 1.0)
    sines = np.clip(np.linalg.svd(b - a @ (a.T @ b), compute_uv=False)[::-1], 0.0, 1.0)
    angles = np.where(sines < np.sqrt(0.5), np.arcsin(sines), np.arccos(cosines))
    return np.sort(np.degrees(angles))


def _reference_class_angles(
    data: np.ndarray, targets: np.ndarray, energy: float = 0.995
) -> dict[int, np.ndarray]:
    classes = np.unique(targets)
    floor = _reference_floor(data)
    centres = np.stack([data[targets == c].mean(axis=0) for c in classes], axis=1)
    centre_basis = _reference_basis(centres, 1.0, floor)
    projected = data - (data @ centre_basis) @ centre_basis.T
    result = {}
    for c in classes:
        inside = targets == c
        if inside.sum() < 2:
            continue
        own = _reference_basis(projected[inside].T, energy, floor)
        rest = _reference_basis(projected[~inside].T, energy, floor)
        result[int(c)] = _reference_angles(own, rest)
    return result


def _mixed_case(
    sizes: list[int], dim: int, seed: int, noise: float = 0.05
) -> tuple[np.ndarray, np.ndarray]:
    """Classes at random centres, varying along two shared directions, two private ones (at
    random angles to everything else) and weak isotropic noise: angles near 0, in between and
    near 90 degrees, and spectra with a tail for the energy cut to cut."""
    rng = np.random.default_rng(seed)
    shared = rng.standard_normal((2, dim))
    blocks = []
    for size in sizes:
        private = rng.standard_normal((2, dim))
        block = 3.0 * rng.standard_normal(dim) + rng.standard_normal((size, 2)) @ shared
        block += rng.uniform(0.3, 1.0) * rng.standard_normal((size, 2)) @ private
        blocks.append(block + noise * rng.standard_normal((size, dim)))
    return np.concatenate(blocks), np.repeat(np.arange(len(sizes)), sizes)


@pytest.mark.parametrize(
    ("sizes", "dim", "energy", "noise", "seed"),
    [
        ([40, 55, 70, 1, 33], 12, 0.995, 0.05, 0),  # rests of > D rows: the Gram path
        ([40, 55, 70, 1, 33], 12, 0.9, 0.05, 1),
        # Energy 1, no noise: every direction above the rounding floors, none below.
        ([30] * 5, 40, 1.0, 0.0, 2),
        ([6, 5, 7], 24, 0.995, 0.05, 3),  # rests of <= D rows: their own SVD
        ([120, 9, 15, 4], 10, 0.995, 0.05, 4),  # a class of more than D rows: its QR first
    ],
)
def test_class_angles_agree_with_the_per_class_svd_reference(
    sizes: list[int], dim: int, energy: float, noise: float, seed: int
) -> None:
    features, labels = _mixed_case(sizes, dim, seed, noise)
    expected = _reference_class_angles(features, labels, energy)
    actual = class_principal_angles(features, labels, energy)
    assert sorted(actual) == sorted(expected)
    for label, angles in expected.items():
        assert angles.size > 0 and actual[label].shape == angles.shape
        np.testing.assert_allclose(actual[label], angles, atol=1e-6, rtol=0)
    # The cases span the histogram, not only its ends.
    every = np.concatenate(list(expected.values()))
    assert every.min() < 10.0 and np.any((every > 20.0) & (every < 70.0))


def test_the_structured_cases_agree_with_the_reference_too() -> None:
    features, labels = _structured(noise=1e-3)
    expected = _reference_class_angles(features, labels)
    actual = class_principal_angles(features, labels)
    for label, angles in expected.items():
        np.testing.assert_allclose(actual[label], angles, atol=1e-6, rtol=0)


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[int, ...]]]:
    """Every torch.linalg factorisation the diagnostic calls, with its input's shape."""
    calls: list[tuple[str, tuple[int, ...]]] = []
    for name in ("svd", "svdvals", "eigh", "eigvalsh", "qr"):
        original = getattr(torch.linalg, name)

        def recorded(matrix: torch.Tensor, *args, _name=name, _original=original, **kwargs):
            calls.append((_name, tuple(matrix.shape)))
            return _original(matrix, *args, **kwargs)

        monkeypatch.setattr(torch.linalg, name, recorded)
    return calls


def test_a_thousand_classes_cost_max_classes_factorisations_of_d_rows(monkeypatch) -> None:
    """1 000 classes of 3 rows, D = 8. The per-class SVD of each rest factorises 1 000
    (2 997, 8) matrices; now 64 classes are diagnosed, each with factorisations of at most
    D rows (the rest's (8, 8) Gram matrix), and only the class centres' (1 000, 8) QR, once,
    sees more than D rows."""
    rng = np.random.default_rng(0)
    dim, classes = 8, 1000
    labels = np.repeat(np.arange(classes), 3)
    features = rng.standard_normal((labels.size, dim)) + 3.0 * rng.standard_normal((classes, dim))[
        labels]
    calls = _recording(monkeypatch)
    per_class = class_principal_angles(features, labels)
    assert len(per_class) == MAX_CLASSES == summarize_angles(per_class).classes
    assert set(per_class) <= set(range(classes))
    big = [call for call in calls if call[1][0] > dim]
    assert big == [("qr", (classes, dim))]
    assert ("eigh", (dim, dim)) in calls
    # Own basis, rest basis, two angle SVDs per class; the centres' QR and SVD, the norm.
    assert 0 < len(calls) <= 4 * MAX_CLASSES + 3
    # Seeded: the same classes again; another seed, others; None, all of them.
    monkeypatch.undo()
    assert set(class_principal_angles(features, labels)) == set(per_class)
    assert set(class_principal_angles(features, labels, seed=1)) != set(per_class)
    assert len(class_principal_angles(features, labels, max_classes=None)) == classes


def test_diagnosed_classes_skip_singletons_and_cap() -> None:
    counts = np.array([5, 1, 2, 0, 9, 3])
    np.testing.assert_array_equal(diagnosed_classes(counts, None), [0, 2, 4, 5])
    np.testing.assert_array_equal(diagnosed_classes(counts, 10), [0, 2, 4, 5])
    chosen = diagnosed_classes(counts, 2, seed=7)
    assert chosen.size == 2 and set(chosen) <= {0, 2, 4, 5} and np.all(np.diff(chosen) > 0)
    np.testing.assert_array_equal(diagnosed_classes(counts, 2, seed=7), chosen)
    with pytest.raises(ValueError, match="max_classes"):
        diagnosed_classes(counts, 0)
    features, labels = _structured()
    with pytest.raises(ValueError, match="max_classes"):
        class_principal_angles(features, labels, max_classes=0)


def test_failed_divide_and_conquer_falls_back_to_qr_iteration(monkeypatch) -> None:
    """gesdd / syevd failing to converge (as on a SimSiam trial's features) is not the end:
    LAPACK's QR-iteration drivers give the same factorisations."""
    features, labels = _structured(noise=1e-3)
    expected = class_principal_angles(features, labels)

    def not_converging(*args, **kwargs):
        raise torch.linalg.LinAlgError("failed to converge")

    for name in ("svd", "svdvals", "eigh"):
        monkeypatch.setattr(torch.linalg, name, not_converging)
    actual = class_principal_angles(features, labels)
    for label, angles in expected.items():
        np.testing.assert_allclose(actual[label], angles, atol=1e-6, rtol=0)
    gram = torch.from_numpy(features.T @ features)
    values, vectors = subspaces._eigh_descending(gram)
    assert torch.all(values[:-1] >= values[1:])
    torch.testing.assert_close(vectors @ torch.diag(values) @ vectors.T, gram)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_class_angles_on_cuda_match_cpu() -> None:
    features, labels = _mixed_case([40, 55, 70, 33], 12, 0)
    expected = class_principal_angles(features, labels)
    actual = class_principal_angles(features, labels, device="cuda")
    for label, angles in expected.items():
        np.testing.assert_allclose(actual[label], angles, atol=1e-6, rtol=0)
