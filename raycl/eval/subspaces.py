"""Principal-angle diagnostic of what an embedding holds beyond its class centres.

HSCL (section 2.2, appendix C) removes the subspace U_c spanned by the class centres,
then for each class i compares the span of its projected samples with the span of the
other classes' projections. Principal angles near 0 degrees mark *shared* features
(directions every class varies along, e.g. colour or pose); angles near 90 degrees mark
*subclass* features (directions only class i varies along). Angles follow Björck & Golub
(1973); small ones are taken from sines (Knyazev & Argentati, 2002), since arccos of a
cosine within rounding of 1 is off by ~1e-6 degrees.

Cost: the other classes' basis is the top of the eigendecomposition of their (D, D) Gram
matrix, the whole split's Gram less the class's own, so no class costs a pass over the N
rows (an SVD of the (N - n_i, D) rest would cost N D^2 per class: 20-50 minutes for a
50 000 x 2048 test split of 1 000 classes). Per diagnosed class the work is O(n_i D^2 + D^3),
and at most MAX_CLASSES classes are diagnosed (a seeded subsample, the same in every trial).
Everything runs in float64 torch, on the caller's device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from raycl.eval.linear import ArrayLike, to_numpy

# The paper reads its histogram by eye ("concentrated around 0 degrees", "close to 90
# degrees"); these cuts, one histogram bin from either end, are ours.
SHARED_BELOW = 10.0
SUBCLASS_ABOVE = 80.0
# Classes diagnosed per call: each costs O(D^3) (an eigendecomposition and SVDs of D x D), so
# ImageNet's 1 000 classes are subsampled (seeded, the same classes in every trial). The
# summary is a per-class mean; 64 classes estimate it well. CIFAR-10, the paper's, has all.
MAX_CLASSES = 64
EPS = float(np.finfo(np.float64).eps)


def _check_energy(energy: float) -> None:
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"energy must be in (0, 1], got {energy}")


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


def _svd_left(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_left_singular` of a tensor: torch's SVD (gesdd on CPU), gesvd on CPU if it fails."""
    try:
        left, values, _ = torch.linalg.svd(matrix, full_matrices=False)
    except torch.linalg.LinAlgError:
        left_np, values_np = _left_singular(matrix.cpu().numpy())
        left, values = (torch.from_numpy(np.ascontiguousarray(x)).to(matrix.device)
                        for x in (left_np, values_np))
    return left, values


def _singular_values(matrix: torch.Tensor) -> torch.Tensor:
    """Singular values, descending (the same gesvd fallback as :func:`_svd_left`)."""
    try:
        return torch.linalg.svdvals(matrix)
    except torch.linalg.LinAlgError:
        import scipy.linalg

        values = scipy.linalg.svd(matrix.cpu().numpy(), compute_uv=False, lapack_driver="gesvd")
        return torch.from_numpy(values).to(matrix.device)


def _eigh_descending(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (descending) and eigenvectors of a symmetric matrix's lower triangle; if the
    divide-and-conquer solver fails to converge, LAPACK's QR-iteration one (syev)."""
    try:
        values, vectors = torch.linalg.eigh(gram)
    except torch.linalg.LinAlgError:
        import scipy.linalg

        values_np, vectors_np = scipy.linalg.eigh(gram.cpu().numpy(), lower=True, driver="ev")
        values, vectors = (torch.from_numpy(x).to(gram.device) for x in (values_np, vectors_np))
    return values.flip(0), vectors.flip(1)


def _energy_cut(squares: torch.Tensor, energy: float) -> int:
    """m = min{k : sum_{j<=k} s_j^2 / sum_j s_j^2 > energy} of descending squares s_j^2 (all
    kept when energy = 1: the whole numerical rank)."""
    ratios = torch.cumsum(squares, 0) / torch.sum(squares)
    return min(int(torch.sum(ratios <= energy)) + 1, squares.numel())


def _row_basis(rows: torch.Tensor, energy: float, floor: float) -> torch.Tensor:
    """Energy-cut basis of the span of ``rows`` ((n, D)), never keeping singular values
    <= floor: the (D, m) left singular vectors of rows^T."""
    matrix = rows.T
    if matrix.shape[1] > matrix.shape[0]:
        # matrix = R^T Q^T has the same U and singular values as the (D, D) R^T: far
        # cheaper than an SVD of (D, n) with n samples, and as accurate.
        matrix = torch.linalg.qr(rows, mode="r").R.T
    if matrix.numel() == 0:
        return matrix.new_zeros((matrix.shape[0], 0))
    left, values = _svd_left(matrix)
    values = values[values > floor]
    if values.numel() == 0:
        return matrix.new_zeros((matrix.shape[0], 0))
    return left[:, : _energy_cut(values**2, energy)]


def _gram_basis(gram: torch.Tensor, energy: float, floor: float) -> torch.Tensor:
    """The same basis from the rows' (D, D) Gram matrix rows^T rows: its eigenvectors are the
    left singular vectors, its eigenvalues the squared singular values; eigenvalues <= floor
    (the Gram's rounding, see :func:`_floors`) are dropped."""
    values, vectors = _eigh_descending(gram)
    values = values[values > floor]
    if values.numel() == 0:
        return gram.new_zeros((gram.shape[0], 0))
    return vectors[:, : _energy_cut(values, energy)]


def _angles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Principal angles in degrees, ascending, between orthonormal bases (D, p) and (D, q)."""
    if a.shape[1] < b.shape[1]:
        a, b = b, a  # b is the smaller one, so (I - a a^T) b has exactly q = min(p, q) sines
    if b.shape[1] == 0:
        return b.new_zeros(0)
    cross = a.T @ b
    cosines = _singular_values(cross).clamp(0.0, 1.0)  # descending
    sines = _singular_values(b - a @ cross).flip(0).clamp(0.0, 1.0)
    angles = torch.where(sines < math.sqrt(0.5), torch.asin(sines), torch.acos(cosines))
    return torch.sort(torch.rad2deg(angles)).values


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
    rows = torch.from_numpy(data.T)
    return _row_basis(rows, energy, _floors(rows)[0]).numpy()


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
    return _angles(torch.from_numpy(a), torch.from_numpy(b)).numpy()


def _floors(data: torch.Tensor) -> tuple[float, float]:
    """Rounding floors of (N, D) data: singular values at or below the first are rounding
    (numpy's matrix_rank tolerance, ||data||_2 max(N, D) eps); Gram eigenvalues at or below
    the second, ||data||_2^2 max(N, D) eps, are the rounding of a Gram matrix of such rows
    (its entries' rounding is ~eps ||data||^2 times the terms summed)."""
    small = data @ data.T if data.shape[0] < data.shape[1] else data.T @ data
    norm = math.sqrt(max(float(torch.linalg.eigvalsh(small)[-1]), 0.0))
    scale = max(data.shape) * EPS
    return norm * scale, norm * norm * scale


def _validated(features: ArrayLike, labels: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """float64 (N, D) features and (N,) integer labels, checked."""
    data = to_numpy(features).astype(np.float64)
    targets = to_numpy(labels)
    if data.ndim != 2 or data.shape[0] == 0 or data.shape[1] == 0:
        raise ValueError(f"features must be a non-empty 2-D (N, D) array, got {data.shape}")
    if targets.shape != (data.shape[0],) or not np.issubdtype(targets.dtype, np.integer):
        raise ValueError(f"labels must be 1-D integers of length {data.shape[0]}")
    if not np.all(np.isfinite(data)):
        raise ValueError("features contain NaN or inf")
    return data, targets


def diagnosed_classes(counts: np.ndarray, max_classes: int | None, seed: int = 0) -> np.ndarray:
    """Which classes the diagnostic covers: those with at least two samples, at most
    ``max_classes`` of them (a uniform draw seeded by ``seed``, so every trial of a sweep
    diagnoses the same classes).

    Args:
        counts: (C,) samples per class, classes in ascending label order.
        max_classes: cap on the classes diagnosed; None for all.
        seed: seed of the draw.

    Returns:
        Ascending indices into ``counts``.

    Raises:
        ValueError: max_classes below 1.
    """
    if max_classes is not None and max_classes < 1:
        raise ValueError(f"max_classes must be at least 1 (or None), got {max_classes}")
    eligible = np.flatnonzero(np.asarray(counts) >= 2)
    if max_classes is None or eligible.size <= max_classes:
        return eligible
    return np.sort(np.random.default_rng(seed).choice(eligible, size=max_classes, replace=False))


def _projected(data: torch.Tensor, inverse: torch.Tensor, classes: int,
               floor: float) -> torch.Tensor:
    """The rows less their component in the span of the class centres (every centre direction
    with a singular value above ``floor``; rank-deficient centres are fine)."""
    sums = data.new_zeros((classes, data.shape[1])).index_add_(0, inverse, data)
    counts = torch.bincount(inverse, minlength=classes).to(data.dtype)
    centre_basis = _row_basis(sums / counts[:, None], 1.0, floor)
    return data - (data @ centre_basis) @ centre_basis.T


def _class_angles(projected: torch.Tensor, inside: torch.Tensor, gram: torch.Tensor,
                  energy: float, floors: tuple[float, float]) -> torch.Tensor:
    """Angles between one class's span and the rest's; ``gram`` is every projected row's."""
    rows = projected[inside]
    own = _row_basis(rows, energy, floors[0])
    if projected.shape[0] - rows.shape[0] <= projected.shape[1]:
        # A rest of at most D rows: its SVD costs no more than an eigendecomposition.
        rest = _row_basis(projected[~inside], energy, floors[0])
    else:
        # The rest's Gram is the total less the class's own: no pass over the other rows.
        rest = _gram_basis(gram - rows.T @ rows, energy, floors[1])
    return _angles(own, rest)


def class_principal_angles(
    features: ArrayLike,
    labels: ArrayLike,
    energy: float = 0.995,
    max_classes: int | None = MAX_CLASSES,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> dict[int, np.ndarray]:
    """Per class, principal angles between its and the other classes' off-centre spans.

    The rest is always every other class (all N rows enter the centres and the Gram matrix);
    only the classes whose angles are computed are capped (:func:`diagnosed_classes`).

    Args:
        features: (N, D) embeddings.
        labels: (N,) integer class labels.
        energy: energy cut for both bases (see `energy_basis`).
        max_classes: most classes diagnosed (a seeded subsample beyond); None for all.
        seed: seed of that subsample.
        device: where the float64 linear algebra runs; None for the CPU.

    Returns:
        Class label -> ascending angles in degrees, for every diagnosed class (those with at
        least two samples, at most ``max_classes``); empty when fewer than two classes are
        present. Its length is the number of classes diagnosed.

    Raises:
        ValueError: bad shapes, non-integer labels, non-finite features, bad energy or
            max_classes.
    """
    _check_energy(energy)
    data, targets = _validated(features, labels)
    classes, inverse_np, counts = np.unique(targets, return_inverse=True, return_counts=True)
    chosen = diagnosed_classes(counts, max_classes, seed)
    if classes.size < 2:
        return {}
    rows = torch.from_numpy(data).to(device or "cpu")
    inverse = torch.from_numpy(inverse_np.reshape(-1)).to(rows.device)
    # Scaled to the raw features, so that the rounding left in the centre directions
    # after projection (or a class sitting exactly on its centre) counts as zero.
    floors = _floors(rows)
    projected = _projected(rows, inverse, classes.size, floors[0])
    gram = projected.T @ projected
    return {int(classes[index]): _class_angles(projected, inverse == index, gram, energy,
                                               floors).cpu().numpy()
            for index in chosen}


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
