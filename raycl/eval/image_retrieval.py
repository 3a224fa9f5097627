"""Image retrieval within one split: rank-k and mAP (the FGVR paper's retrieval protocol).

Each query (every row of the split, or a seeded sample of ``max_queries`` rows) is ranked against
the whole rest of its split by cosine similarity (inner products of L2-normalised float32
features). The similarities are computed in blocks of queries with one matrix product on the
scoring device (the GPU when there is one), so the work is (queries × N) pairs, not N², and the
memory O(block × N) whatever the split's size. Every metric is exact over the full gallery: rank-k
from the rank of the first positive, AP from, for every positive, the count of items scoring at
least as high (no sort of the row, no top-k cut). Pure numpy/torch: no Ray.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from raycl.eval.queries import sample_queries
from raycl.eval.threads import exact_float32_matmul
from raycl.kmeans import l2_normalize

# Queries per block are chosen so one block holds about this many (query, item) pairs: the
# similarities and the per-pair work arrays of a block stay at a few hundred MB.
CHUNK_PAIRS = 1 << 22
# On a GPU (beside the model being trained) larger blocks keep it busy: about 2 GB of work arrays.
CUDA_CHUNK_PAIRS = 1 << 25


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


def similarity_block(queries: torch.Tensor, gallery: torch.Tensor) -> torch.Tensor:
    """(B, N) inner products of a block of unit query rows with every unit gallery row: the only
    place retrieval scores (query, item) pairs (tests count its calls)."""
    return queries @ gallery.T


def _first_positive_rank(similarities: torch.Tensor, matches: torch.Tensor) -> torch.Tensor:
    """Rank (0-based) of each row's first positive, ties ranked by index: the items scoring
    above the best positive, plus those scoring the same at a lower index.

    Args:
        similarities: (B, N) similarities, the query's own column at -inf.
        matches: (B, N) bool, the positives (the query's own column False).

    Returns:
        (B,) int64 ranks (meaningless for a row without a positive).
    """
    best = torch.where(matches, similarities, -torch.inf).max(dim=1, keepdim=True).values
    # argmax returns the first maximum: the lowest index among the best-scoring positives.
    first = (matches & (similarities == best)).to(torch.uint8).argmax(dim=1, keepdim=True)
    index = torch.arange(similarities.shape[1], device=similarities.device)
    tied_before = (similarities == best) & (index < first)
    return (similarities > best).sum(dim=1) + tied_before.sum(dim=1)


def _average_precision(
    similarities: torch.Tensor, matches: torch.Tensor, positives: torch.Tensor
) -> torch.Tensor:
    """Average precision of each row over the whole gallery, with tied scores grouped as sklearn
    does, without sorting the row.

    ``sklearn.metrics.average_precision_score`` sums, over the distinct score thresholds,
    (recall gain) × (precision of everything scoring at least the threshold). Equivalently: the
    mean over the positives p of (positives scoring >= s_p) / (items scoring >= s_p). The
    positives' scores, sorted, are the thresholds; one ``searchsorted`` of every item's score
    into them and a histogram give every "items scoring >= s_p" in O(N log P) per row.

    Args:
        similarities: (B, N) similarities, the query's own column at -inf.
        matches: (B, N) bool, the positives (the query's own column False).
        positives: (B,) positives per row.

    Returns:
        (B,) float64 average precision; NaN for a row without any positive.
    """
    most = max(1, int(positives.max()))
    # Ascending thresholds per row; a row with fewer positives is padded at the front with -inf
    # (the non-positives that topk fills in), which only the query's own -inf equals: it falls
    # below every real threshold, so the query never counts as an item.
    thresholds = torch.where(matches, similarities, -torch.inf).topk(most, dim=1).values.flip(1)
    below_or_at = torch.searchsorted(thresholds, similarities, right=True)
    histogram = torch.zeros((len(similarities), most + 1), dtype=torch.int64,
                            device=similarities.device)
    histogram.scatter_add_(1, below_or_at, torch.ones_like(below_or_at))
    # Items scoring >= threshold i: those whose score passes thresholds 0..i.
    items_at_least = histogram.flip(1).cumsum(dim=1).flip(1)[:, 1:]
    positives_at_least = most - torch.searchsorted(thresholds, thresholds, right=False)
    real = torch.arange(most, device=similarities.device) >= (most - positives)[:, None]
    precision = positives_at_least.double() / items_at_least.double()
    return torch.where(real, precision, 0.0).sum(dim=1) / positives.double()


def _score_block(
    unit: torch.Tensor, codes: torch.Tensor, queries: torch.Tensor, ks: Sequence[int]
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """AP and rank-k hits of the answerable queries of one block, over the full gallery.

    Args:
        unit: (N, D) unit rows of the whole split (the gallery).
        codes: (N,) integer label codes of the rows.
        queries: (B,) row indices of the block's queries.
        ks: the k of each rank-k.

    Returns:
        (A,) AP of the block's answerable queries (those with a positive among the others), and
        k -> (A,) bool whether one of the first k items is a positive.
    """
    rows = torch.arange(len(queries), device=unit.device)
    similarities = similarity_block(unit[queries], unit)
    # The query leaves its own ranking by index (a duplicate at another index still counts):
    # its similarity is -inf, below every finite one, and it is no positive.
    similarities[rows, queries] = -torch.inf
    matches = codes[None, :] == codes[queries][:, None]
    matches[rows, queries] = False
    positives = matches.sum(dim=1)
    answerable = positives > 0
    rank = _first_positive_rank(similarities, matches)[answerable]
    average_precision = _average_precision(similarities, matches, positives)[answerable]
    return average_precision, {k: rank < k for k in ks}


def retrieval_scores(
    features: np.ndarray,
    labels: np.ndarray,
    ks: Sequence[int] = (1, 5),
    query_chunk: int | None = None,
    max_queries: int | None = None,
    seed: int = 0,
    device: torch.device | None = None,
) -> dict[str, float]:
    """Rank-k and mAP of retrieving same-label images within one split.

    Each query is ranked against the other N−1 rows of the same split by cosine similarity
    (inner products of L2-normalised float32 features). The query is left out by its index, not
    by its similarity, so an identical copy at another index still counts as an item. Among
    items of equal similarity the lower index ranks first. The queries are every row, or
    ``max_queries`` rows drawn uniformly with ``seed`` (:func:`raycl.eval.queries.sample_queries`)
    when the split is larger; the gallery is always the whole split.

    - ``rank<k>``: share of queries with at least one same-label item among the top k (the
      FGVR paper's "rank-k", a.k.a. recall@k).
    - ``map``: mean over queries of the average precision over the whole ranking (every
      positive's rank in the full gallery, not a top-k cut), as
      ``sklearn.metrics.average_precision_score(labels_others == label_q, similarities)``
      computes it per query (tied similarities grouped into one threshold).

    Queries whose label has no other member in the split (sklearn's AP is undefined for them:
    it warns and returns 0) are left out of every metric: nothing could be retrieved for them.
    When no query has another member of its label, every metric is NaN. Cost: (queries × N)
    similarities, computed and sorted ``query_chunk`` queries at a time on ``device``.

    Args:
        features: (N, D) features, N >= 2; any scale (they are L2-normalised here).
        labels: (N,) labels of the rows (compared with ``==``).
        ks: the k of each ``rank<k>`` metric, distinct integers >= 1 (a k above N−1 means the
            whole ranking).
        query_chunk: queries scored at once; None: about ``CHUNK_PAIRS / N`` (CUDA:
            ``CUDA_CHUNK_PAIRS / N``) so a block's (query, item) arrays stay bounded.
        max_queries: most queries to score (None: every row).
        seed: seed of the query draw when ``max_queries`` is below N.
        device: where the products and sorts run (None: the CPU).

    Returns:
        ``{"rank<k>": share in [0, 1] for each k, "map": mean AP in [0, 1]}``.

    Raises:
        ValueError: features not 2-D or not finite, labels not 1-D of the same length, fewer
            than 2 samples, bad ``ks``, ``query_chunk`` or ``max_queries``.

    Example:
        >>> x = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
        >>> retrieval_scores(x, np.array([0, 0, 1, 1]), ks=(1,))
        {'rank1': 1.0, 'map': 1.0}
    """
    features, labels = _check_inputs(features, labels, ks)
    num = features.shape[0]
    device = device or torch.device("cpu")
    if query_chunk is None:
        query_chunk = max(1, (CUDA_CHUNK_PAIRS if device.type == "cuda" else CHUNK_PAIRS) // num)
    if query_chunk < 1:
        raise ValueError(f"query_chunk must be >= 1, got {query_chunk}")
    queries = sample_queries(num, max_queries, seed)
    unit = torch.from_numpy(l2_normalize(features)).to(device)
    # Labels as small ints: comparisons over (B, N) arrays are then cheap whatever the dtype.
    codes = torch.from_numpy(np.unique(labels, return_inverse=True)[1].reshape(-1)).to(device)
    ap_parts: list[torch.Tensor] = []
    hit_parts: dict[int, list[torch.Tensor]] = {k: [] for k in ks}
    with torch.no_grad(), exact_float32_matmul():
        for start in range(0, len(queries), query_chunk):
            block = torch.from_numpy(queries[start:start + query_chunk]).to(device)
            average_precision, hits = _score_block(unit, codes, block, ks)
            ap_parts.append(average_precision.cpu())
            for k in ks:
                hit_parts[k].append(hits[k].cpu())
    average_precision = torch.cat(ap_parts).numpy()
    if average_precision.size == 0:
        return {**{f"rank{k}": float("nan") for k in ks}, "map": float("nan")}
    results = {f"rank{k}": float(torch.cat(hit_parts[k]).double().mean()) for k in ks}
    results["map"] = float(np.mean(average_precision))
    return results
