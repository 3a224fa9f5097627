"""Image retrieval within one split: rank-k and mAP (the FGVR paper's retrieval protocol).

Every image of a split is a query against the rest of the same split, ranked by cosine
similarity (faiss ``IndexFlatIP`` on L2-normalised float32 features). Pure numpy/faiss: no Ray,
no torch needed to compute the numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import faiss
import numpy as np

from raycl.cluster import l2_normalize

# Queries per faiss search are chosen so one chunk holds about this many (query, item) pairs:
# the similarities, ids and per-pair work arrays of a chunk stay at a few hundred MB.
CHUNK_PAIRS = 1 << 22


def _check_inputs(
    features: np.ndarray, labels: np.ndarray, ks: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Validate the inputs of :func:`retrieval_scores`; return them as numpy arrays."""
    features = np.asarray(features)
    labels = np.asarray(labels)
    if features.ndim != 2:
        raise ValueError(f"features must be 2-D (N, D), got shape {features.shape}")
    if labels.ndim != 1 or labels.shape[0] != features.shape[0]:
        raise ValueError(f"labels must be 1-D with one entry per feature row "
                         f"({features.shape[0]}), got shape {labels.shape}")
    if features.shape[0] < 2:
        raise ValueError(f"retrieval needs at least 2 samples (a query and another item), "
                         f"got {features.shape[0]}")
    if not np.issubdtype(features.dtype, np.number) or not np.all(np.isfinite(features)):
        raise ValueError("features must be finite numbers")
    if not ks or any(isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1
                     for k in ks):
        raise ValueError(f"ks must be a non-empty sequence of integers >= 1, got {ks!r}")
    if len(set(ks)) != len(ks):
        raise ValueError(f"ks must be distinct, got {ks!r}")
    return features, labels


def _order_ties_by_index(scores: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Reorder each row's ``ids`` so that items of equal score come in index order.

    faiss sorts by score but leaves the order among equal scores unspecified; rank-k looks at a
    prefix of the ranking, so a fixed tie order makes it deterministic.

    Args:
        scores: (B, M) similarities, each row sorted in descending order.
        ids: (B, M) the item index behind each score (each row a permutation of distinct ids).

    Returns:
        (B, M) ids, sorted by (score descending, index ascending) within each row.
    """
    num_items = int(ids.max()) + 1
    # Tie group number along the row (non-decreasing), then index: one sortable int key whose
    # rows are already sorted except inside tie groups, which a stable sort fixes cheaply.
    group = np.zeros(scores.shape, dtype=np.int64)
    group[:, 1:] = np.cumsum(scores[:, 1:] != scores[:, :-1], axis=1)
    key = np.sort(group * num_items + ids, axis=1, kind="stable")
    return key % num_items


def _average_precision(scores: np.ndarray, matches: np.ndarray) -> np.ndarray:
    """Average precision of each row of a ranking, with tied scores grouped as sklearn does.

    ``sklearn.metrics.average_precision_score`` sums, over the distinct score thresholds,
    (recall gain) × (precision of everything scoring at least the threshold). Equivalently: the
    mean over the positives of the precision at the end of the positive's tie group.

    Args:
        scores: (B, M) similarities, each row sorted in descending order.
        matches: (B, M) bool, whether the item at that rank shares the query's label.

    Returns:
        (B,) float64 average precision; NaN for a row without any positive.
    """
    num_items = scores.shape[1]
    positions = np.arange(num_items)
    hits = np.cumsum(matches, axis=1)
    group_end = np.ones(scores.shape, dtype=bool)
    group_end[:, :-1] = scores[:, :-1] != scores[:, 1:]
    # For every rank, the last rank of its tie group: a reversed running minimum over the
    # positions that end a group.
    last = np.where(group_end, positions, num_items)
    last = np.minimum.accumulate(last[:, ::-1], axis=1)[:, ::-1]
    precision = np.take_along_axis(hits, last, axis=1) / (last + 1.0)
    positives = hits[:, -1]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(matches, precision, 0.0).sum(axis=1) / positives


def retrieval_scores(
    features: np.ndarray,
    labels: np.ndarray,
    ks: Sequence[int] = (1, 5),
    query_chunk: int | None = None,
) -> dict[str, float]:
    """Rank-k and mAP of retrieving same-label images within one split.

    Every row is a query; the other N−1 rows of the same split are ranked by cosine
    similarity (faiss ``IndexFlatIP`` on L2-normalised float32 features). The query is left
    out by its index, not by its similarity, so an identical copy at another index still
    counts as an item. Among items of equal similarity the lower index ranks first.

    - ``rank<k>``: share of queries with at least one same-label item among the top k (the
      FGVR paper's "rank-k", a.k.a. recall@k).
    - ``map``: mean over queries of the average precision over the whole ranking, as
      ``sklearn.metrics.average_precision_score(labels_others == label_q, similarities)``
      computes it per query (tied similarities grouped into one threshold).

    Queries whose label has no other member in the split (sklearn's AP is undefined for them:
    it warns and returns 0) are left out of every metric: nothing could be retrieved for them.
    When no query has another member of its label, every metric is NaN.

    Args:
        features: (N, D) features, N >= 2; any scale (they are L2-normalised here).
        labels: (N,) labels of the rows (compared with ``==``).
        ks: the k of each ``rank<k>`` metric, distinct integers >= 1 (a k above N−1 means the
            whole ranking).
        query_chunk: queries searched at once; None: about ``CHUNK_PAIRS / N`` so a chunk's
            (query, item) arrays stay bounded for large splits.

    Returns:
        ``{"rank<k>": share in [0, 1] for each k, "map": mean AP in [0, 1]}``.

    Raises:
        ValueError: features not 2-D or not finite, labels not 1-D of the same length, fewer
            than 2 samples, or bad ``ks``.

    Example:
        >>> x = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
        >>> retrieval_scores(x, np.array([0, 0, 1, 1]), ks=(1,))
        {'rank1': 1.0, 'map': 1.0}
    """
    features, labels = _check_inputs(features, labels, ks)
    num = features.shape[0]
    if query_chunk is None:
        query_chunk = max(1, CHUNK_PAIRS // num)
    if query_chunk < 1:
        raise ValueError(f"query_chunk must be >= 1, got {query_chunk}")
    unit = l2_normalize(features)
    index = faiss.IndexFlatIP(unit.shape[1])
    index.add(unit)
    # Labels as small ints: comparisons over (B, N) arrays are then cheap whatever the dtype.
    _, codes = np.unique(labels, return_inverse=True)
    codes = codes.reshape(-1)
    ap_parts: list[np.ndarray] = []
    hit_parts: dict[int, list[np.ndarray]] = {k: [] for k in ks}
    for start in range(0, num, query_chunk):
        queries = np.arange(start, min(start + query_chunk, num))
        scores, ids = index.search(unit[queries], num)
        ids = _order_ties_by_index(scores, ids)
        # k = N returns every item once, so dropping the query's own index leaves N−1 per row.
        others = ids != queries[:, None]
        scores = scores[others].reshape(len(queries), num - 1)
        ids = ids[others].reshape(len(queries), num - 1)
        matches = codes[ids] == codes[queries][:, None]
        answerable = matches.any(axis=1)
        ap_parts.append(_average_precision(scores, matches)[answerable])
        for k in ks:
            hit_parts[k].append(matches[answerable, :k].any(axis=1))
    average_precision = np.concatenate(ap_parts)
    if average_precision.size == 0:
        return {**{f"rank{k}": float("nan") for k in ks}, "map": float("nan")}
    results = {f"rank{k}": float(np.mean(np.concatenate(hit_parts[k]))) for k in ks}
    results["map"] = float(np.mean(average_precision))
    return results
