"""Label-free figures of a representation: how many directions it uses, and whether it has
collapsed, read from the features alone (no labels, no probe). What a sweep on unlabelled data
selects on, and what tells a collapsed trial from a healthy one before any probe could.

- :func:`rankme`: RankMe (Garrido et al., ICML 2023, eq. 1): the exponential of the entropy of
  the normalised singular values of the (uncentred) feature matrix, each share plus
  ``epsilon = 1e-7`` as the paper's code does. 1 for a single direction, min(N, D) for a flat
  spectrum.
- :func:`alpha_req`: α-ReQ (Agrawal et al., NeurIPS 2022): the power-law decay of the feature
  covariance's eigenspectrum, λ_i ∝ i^-α, fit by least squares on log λ_i against log i. Small α:
  a flat spectrum (many directions, noisy); large α: a few directions dominate. The paper finds
  good representations near α ≈ 1; it is not a quantity to maximise.
- :func:`normalized_std`: the mean per-dimension standard deviation of the L2-normalised
  features times √D (lightly's ``std_of_l2_normalized``, scaled): about 1 for features spread
  isotropically over the sphere, 0 for complete collapse (every row the same direction).

:func:`label_free_scores` names them ``[stage<j>/]<split>/label_free/{rankme,alpha,std}``, on a
seeded subset of rows (``eval.label_free_rows``): the figures are spectra of a D × D matrix, and
a few thousand rows pin them down (RankMe's paper uses 25 600 images for D = 2048; its estimate
moves by under 1 % above ~2D rows). Pure NumPy in float64, on rank 0 beside the probes.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from raycl.config.metric_names import LABEL_FREE, metric_name

# RankMe's epsilon, added to each normalised singular value (Garrido et al. 2023, eq. 1).
RANKME_EPSILON = 1e-7
# Eigenvalues below this share of the largest are numerical zeros: left out of α-ReQ's fit.
_EIGEN_FLOOR = 1e-10


def _checked(features: np.ndarray) -> np.ndarray:
    data = np.asarray(features, dtype=np.float64)
    if data.ndim != 2 or data.shape[0] < 2 or data.shape[1] == 0:
        raise ValueError(f"features must be a 2-D (N, D) array with N >= 2, got {data.shape}")
    if not np.all(np.isfinite(data)):
        raise ValueError("features contain NaN or inf")
    return data


def _gram_eigenvalues(data: np.ndarray) -> np.ndarray:
    """Eigenvalues of ``data.T @ data`` (the squared singular values), largest first, >= 0:
    O(N·D²) on the smaller side of the matrix, cheaper than an SVD of a tall N × D one."""
    gram = data.T @ data if data.shape[0] >= data.shape[1] else data @ data.T
    return np.clip(np.linalg.eigvalsh(gram)[::-1], 0.0, None)


def rankme(features: np.ndarray, epsilon: float = RANKME_EPSILON) -> float:
    """RankMe of an (N, D) feature matrix (Garrido et al. 2023).

    Args:
        features: (N, D) features, N >= 2; not centred (as the paper).
        epsilon: added to each normalised singular value (the paper's 1e-7).

    Returns:
        exp(-Σ p_k log p_k), p_k = σ_k / Σσ + epsilon: in [1, min(N, D)] up to epsilon; 1.0 for
        an all-zero matrix (no direction at all: the fully collapsed end).

    Raises:
        ValueError: not a finite 2-D array of at least two rows.

    Example:
        >>> round(rankme(np.eye(4)), 3)
        4.0
    """
    singular = np.sqrt(_gram_eigenvalues(_checked(features)))
    total = singular.sum()
    if total <= 0:
        return 1.0
    shares = singular / total + epsilon
    return float(np.exp(-np.sum(shares * np.log(shares))))


def alpha_req(features: np.ndarray) -> float:
    """α-ReQ of an (N, D) feature matrix (Agrawal et al. 2022): minus the slope of the least
    squares line through (log i, log λ_i), λ the eigenvalues of the features' covariance,
    i = 1, 2, ... (eigenvalues below 1e-10 of the largest left out).

    Args:
        features: (N, D) features, N >= 2 (centred here: a covariance).

    Returns:
        α >= 0 in practice; 0.0 when fewer than two eigenvalues are non-zero (nothing to fit:
        a collapsed or single-direction representation).

    Raises:
        ValueError: not a finite 2-D array of at least two rows.

    Example:
        >>> spectrum = np.diag(np.arange(1, 9, dtype=float) ** -0.5)  # λ_i ∝ i^-1
        >>> round(alpha_req(np.vstack([spectrum, -spectrum])), 3)
        1.0
    """
    data = _checked(features)
    eigen = _gram_eigenvalues(data - data.mean(axis=0, keepdims=True)) / len(data)
    kept = eigen[eigen > eigen[0] * _EIGEN_FLOOR] if eigen[0] > 0 else eigen[:0]
    if len(kept) < 2:
        return 0.0
    ranks = np.log(np.arange(1, len(kept) + 1, dtype=np.float64))
    slope = np.polyfit(ranks, np.log(kept), 1)[0]
    return float(-slope)


def normalized_std(features: np.ndarray) -> float:
    """√D times the mean over dimensions of the standard deviation of the L2-normalised rows.

    Args:
        features: (N, D) features, N >= 2. An all-zero row counts as the zero vector.

    Returns:
        About 1 for rows spread evenly over the sphere, 0.0 when every row points the same way.

    Raises:
        ValueError: not a finite 2-D array of at least two rows.

    Example:
        >>> normalized_std(np.ones((5, 3)))
        0.0
    """
    data = _checked(features)
    norms = np.linalg.norm(data, axis=1, keepdims=True)
    unit = data / np.where(norms > 0, norms, 1.0)
    return float(unit.std(axis=0).mean() * np.sqrt(data.shape[1]))


FIGURES = {"rankme": rankme, "alpha": alpha_req, "std": normalized_std}


def label_free_scores(
    features: Mapping[str, np.ndarray],
    splits: tuple[str, ...] = ("val", "test"),
    stage: int | None = None,
    max_rows: int | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """The label-free figures of each of ``splits`` in ``features``:
    ``[stage<j>/]<split>/label_free/{rankme,alpha,std}``.

    Args:
        features: split name -> (N, D) features; splits not in ``features`` are skipped.
        splits: which splits to score.
        stage: MCL's stage alone (the metric's ``stage<j>/`` prefix); None: the representation.
        max_rows: score a seeded subset of at most this many rows (None: every row).
        seed: the subset's seed (the same rows at every evaluation of a trial).

    Returns:
        The figures; none for a split of fewer than two rows.
    """
    metrics: dict[str, float] = {}
    for split in splits:
        values = features.get(split)
        if values is None or len(values) < 2:
            continue
        if max_rows is not None and len(values) > max_rows:
            rows = np.random.default_rng(seed).choice(len(values), max_rows, replace=False)
            values = values[np.sort(rows)]
        metrics.update({metric_name(split, LABEL_FREE, name, stage=stage): figure(values)
                        for name, figure in FIGURES.items()})
    return metrics


__all__ = ["FIGURES", "RANKME_EPSILON", "alpha_req", "label_free_scores", "normalized_std",
           "rankme"]
