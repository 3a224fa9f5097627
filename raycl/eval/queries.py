"""Which rows of a split are scored as queries (retrieval, kNN) when their number is capped."""

from __future__ import annotations

import numpy as np


def sample_queries(num_rows: int, cap: int | None, seed: int) -> np.ndarray:
    """Indices of the query rows: every row when ``cap`` is None or not below ``num_rows``,
    else ``cap`` distinct rows drawn uniformly with ``seed`` (sorted).

    A uniform draw keeps a mean over queries (rank-k, mAP, kNN accuracy) an unbiased estimate of
    the mean over every row; the same seed draws the same rows at every evaluation of a trial, so
    its epochs compare on one query set.

    Args:
        num_rows: rows of the split.
        cap: most queries to score, >= 1; None: no cap.
        seed: seed of the draw.

    Returns:
        (Q,) int64 row indices in increasing order, Q = min(cap, num_rows).
    """
    if cap is not None and cap < 1:
        raise ValueError(f"cap must be >= 1 or None, got {cap}")
    if cap is None or cap >= num_rows:
        return np.arange(num_rows, dtype=np.int64)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(num_rows, size=cap, replace=False)).astype(np.int64)


__all__ = ["sample_queries"]
