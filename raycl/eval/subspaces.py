"""Principal-angle diagnostic of what an embedding holds beyond its class centres.

HSCL (section 2.2, appendix C) removes the subspace U_c spanned by the class centres,
then for each class i compares the span of its projected samples with the span of the
other classes' projections. Principal angles near 0 degrees mark *shared* features
(directions every class varies along, e.g. colour or pose); angles near 90 degrees mark
*subclass* features (directions only class i varies along). Angles follow Björck & Golub
(1973); small ones are taken from sines (Knyazev & Argentati, 2002), since arccos of a
cosine within rounding of 1 is off by ~1e-6 degrees.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raycl.eval.linear import ArrayLike, to_numpy

# The paper reads its histogram by eye ("concentrated around 0 degrees", "close to 90
# degrees"); these cuts, one histogram bin from either end, are ours.
SHARED_BELOW = 10.0
SUBCLASS_ABOVE = 80.0


def _check_energy(energy: float) -> None:
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"energy must be in (0, 1], got {energy}")


def _floor(data: np.ndarray) -> float:
    """Singular values at or below this are rounding (numpy's matrix_rank tolerance)."""
    return float(np.linalg.norm(data, ord=2) * max(data.shape) * np.finfo(np.float64).eps)


def _left_singular(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Left singular vectors and singular values. LAPACK's divide-and-conquer SVD (gesdd, what
    numpy calls) can fail to converge on finite but ill-conditioned matrices (a SimSiam trial's
    test features did, ending the trial after training); the slower QR-iteration driver (gesvd)
    then gets the same factorisation."""
    try:
        left, values, _ = np.linalg.svd(matrix, full_matrices=False)
    except np.linalg.LinAlgError:
        import scipy.linalg

        left, values, _ = scipy.linalg.svd(matrix, full_matrices=False, lapack_driver="gesvd")
    return left, values


def _basis(matrix: np.ndarray, energy: float, floor: float) -> np.ndarray:
    """Energy-cut left singular vectors, never keeping singular values <= floor."""
    if matrix.shape[1] > matrix.shape[0]:
        # matrix = R^T Q^T has the same U and singular values as the (D, D) R^T: far
        # cheaper than an SVD of (D, N) with N samples, and as accurate.
        matrix = np.linalg.qr(matrix.T, mode="r").T
    left, values = _left_singular(matrix)
    values = values[values > floor]
    if values.size == 0:
        return np.zeros((matrix.shape[0], 0))
    ratios = np.cumsum(values**2) / np.sum(values**2)
    # m = min{k : ratio_k > energy}; energy = 1 keeps the whole numerical rank.
    keep = min(int(np.sum(ratios <= energy)) + 1, values.size)
    return left[:, :keep]


def energy_basis(matrix: np.ndarray, energy: float = 0.995) -> np.ndarray:
    """First m left singular vectors, m = min{k : sum_{j<=k} s_j^2 / sum_j s_j^2 > energy}.

    As in HSCL appendix C.2; numerically-zero singular values are dropped first.

    Args:
        matrix: (D, n) matrix whose columns span the subspace.
        energy: fraction of the squared singular values the basis must exceed, in (0, 1].

    Returns:
        float64 (D, m) array with orthonormal columns; (D, 0) for an all-zero matrix.

    Raises:
        ValueError: energy outside (0, 1], matrix not 2-D or not finite.
    """
    _check_energy(energy)
    data = np.asarray(matrix, dtype=np.float64)
    if data.ndim != 2:
        raise ValueError(f"matrix must be 2-D (D, n), got shape {data.shape}")
    if not np.all(np.isfinite(data)):
        raise ValueError("matrix contains NaN or inf")
    if data.size == 0:
        return np.zeros((data.shape[0], 0))
    return _basis(data, energy, _floor(data))


def principal_angles(basis_a: np.ndarray, basis_b: np.ndarray) -> np.ndarray:
    """Principal angles between two subspaces given by orthonormal bases.

    Args:
        basis_a: (D, p) orthonormal columns.
        basis_b: (D, q) orthonormal columns.

    Returns:
        float64 array of min(p, q) angles in degrees, ascending; empty if p or q is 0.

    Raises:
        ValueError: bases not 2-D, row counts differ, or columns not orthonormal.
    """
    a = np.asarray(basis_a, dtype=np.float64)
    b = np.asarray(basis_b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"bases must be 2-D with equal row counts, got {a.shape}, {b.shape}")
    for basis in (a, b):
        if not np.allclose(basis.T @ basis, np.eye(basis.shape[1]), atol=1e-6):
            raise ValueError("basis columns must be orthonormal")
    if a.shape[1] < b.shape[1]:
        a, b = b, a  # b is the smaller one, so (I - a a^T) b has exactly q = min(p, q) sines
    if b.shape[1] == 0:
        return np.zeros(0)
    cosines = np.clip(np.linalg.svd(a.T @ b, compute_uv=False), 0.0, 1.0)  # descending
    sines = np.clip(np.linalg.svd(b - a @ (a.T @ b), compute_uv=False)[::-1], 0.0, 1.0)
    angles = np.where(sines < np.sqrt(0.5), np.arcsin(sines), np.arccos(cosines))
    return np.sort(np.degrees(angles))


def class_principal_angles(
    features: ArrayLike, labels: ArrayLike, energy: float = 0.995
) -> dict[int, np.ndarray]:
    """Per class, principal angles between its and the other classes' off-centre spans.

    Args:
        features: (N, D) embeddings.
        labels: (N,) integer class labels.
        energy: energy cut for both bases (see `energy_basis`).

    Returns:
        Class label -> ascending angles in degrees, for every class with at least two
        samples; empty when fewer than two classes are present.

    Raises:
        ValueError: bad shapes, non-integer labels, non-finite features, or bad energy.
    """
    _check_energy(energy)
    data = to_numpy(features).astype(np.float64)
    targets = to_numpy(labels)
    if data.ndim != 2 or data.shape[0] == 0 or data.shape[1] == 0:
        raise ValueError(f"features must be a non-empty 2-D (N, D) array, got {data.shape}")
    if targets.shape != (data.shape[0],) or not np.issubdtype(targets.dtype, np.integer):
        raise ValueError(f"labels must be 1-D integers of length {data.shape[0]}")
    if not np.all(np.isfinite(data)):
        raise ValueError("features contain NaN or inf")
    classes = np.unique(targets)
    if classes.size < 2:
        return {}
    # Scaled to the raw features, so that the rounding left in the centre directions
    # after projection (or a class sitting exactly on its centre) counts as zero.
    floor = _floor(data)
    centres = np.stack([data[targets == c].mean(axis=0) for c in classes], axis=1)
    # Every centre direction with a non-negligible singular value; rank-deficient is fine.
    centre_basis = _basis(centres, 1.0, floor)
    projected = data - (data @ centre_basis) @ centre_basis.T
    result: dict[int, np.ndarray] = {}
    for c in classes:
        inside = targets == c
        if inside.sum() < 2:
            continue
        own = _basis(projected[inside].T, energy, floor)
        rest = _basis(projected[~inside].T, energy, floor)
        result[int(c)] = principal_angles(own, rest)
    return result


@dataclass
class AngleSummary:
    """Shared and subclass direction counts, averaged over classes.

    `shared` / `subclass`: mean per-class number of angles below `shared_below` / above
    `subclass_above` degrees; `angles`: all classes' angles, for a histogram.
    """

    shared: float
    subclass: float
    angles: np.ndarray
    classes: int
    shared_below: float = SHARED_BELOW
    subclass_above: float = SUBCLASS_ABOVE


def summarize_angles(
    per_class: dict[int, np.ndarray],
    shared_below: float = SHARED_BELOW,
    subclass_above: float = SUBCLASS_ABOVE,
) -> AngleSummary:
    """Count near-0 (shared) and near-90 degree (subclass) angles per class.

    Args:
        per_class: class label -> angles in degrees, from `class_principal_angles`.
        shared_below: angles strictly below this are shared directions. The paper reads
            its histogram by eye; this cut and the next (see SHARED_BELOW) are ours.
        subclass_above: angles strictly above this are subclass directions.

    Returns:
        The summary; shared and subclass are NaN when `per_class` is empty.

    Raises:
        ValueError: unless 0 <= shared_below < subclass_above <= 90.
    """
    if not 0.0 <= shared_below < subclass_above <= 90.0:
        raise ValueError(
            f"need 0 <= shared_below < subclass_above <= 90: {shared_below, subclass_above}"
        )
    values = [np.asarray(v, dtype=np.float64) for v in per_class.values()]
    if not values:
        return AngleSummary(np.nan, np.nan, np.zeros(0), 0, shared_below, subclass_above)
    shared = float(np.mean([np.sum(v < shared_below) for v in values]))
    subclass = float(np.mean([np.sum(v > subclass_above) for v in values]))
    return AngleSummary(
        shared, subclass, np.concatenate(values), len(values), shared_below, subclass_above
    )


def plot_angle_histogram(summary: AngleSummary, path: Path, title: str) -> None:
    """Save a PNG histogram of the principal angles with the two cuts marked.

    Args:
        summary: output of `summarize_angles`.
        path: where the PNG goes.
        title: figure title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    axis.hist(summary.angles, bins=np.linspace(0.0, 90.0, 19))
    for cut in (summary.shared_below, summary.subclass_above):
        axis.axvline(cut, color="black", linestyle="--", linewidth=1)
    axis.set(title=title, xlabel="principal angle (degrees)", ylabel="count", xlim=(0, 90))
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
