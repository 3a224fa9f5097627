"""Spectrum diagnostics of an embedding matrix (dimensional collapse, effective rank)."""

from __future__ import annotations

import numpy as np

from raycl.eval.linear import ArrayLike, to_numpy


def singular_values(features: ArrayLike, center: bool = True) -> np.ndarray:
    """Singular values of the (column-centred) embedding matrix, largest first.

    Centring removes the mean embedding, which would otherwise show up as one large
    singular value unrelated to how many directions the representation uses.

    Args:
        features: (N, D) embeddings.
        center: subtract the per-dimension mean first.

    Returns:
        float64 array of min(N, D) singular values in descending order.
    """
    data = to_numpy(features).astype(np.float64)
    if data.ndim != 2 or data.shape[0] == 0 or data.shape[1] == 0:
        raise ValueError(f"features must be a non-empty 2-D (N, D) array, got {data.shape}")
    if not np.all(np.isfinite(data)):
        raise ValueError("features contain NaN or inf")
    if center:
        data = data - data.mean(axis=0, keepdims=True)
    return np.linalg.svd(data, compute_uv=False)


def effective_rank(features: ArrayLike, center: bool = True) -> float:
    """Effective rank (Roy & Vetterli, 2007): exp of the entropy of normalised singular values.

    Ranges from 1 (a single direction) to min(N, D) (all singular values equal).

    Args:
        features: (N, D) embeddings.
        center: subtract the per-dimension mean first (see `singular_values`).

    Returns:
        The effective rank; 0.0 for a matrix that is all zeros after centring (complete
        collapse), where the definition does not apply.
    """
    values = singular_values(features, center=center)
    total = values.sum()
    if total <= 0:
        return 0.0
    probabilities = values / total
    probabilities = probabilities[probabilities > 0]  # 0 * log 0 = 0
    entropy = -float(np.sum(probabilities * np.log(probabilities)))
    return float(np.exp(entropy))
