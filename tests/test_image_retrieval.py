"""Image retrieval within a split: rank-k by hand, mAP against sklearn's per-query AP."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from sklearn.metrics import average_precision_score

from raycl.eval.image_retrieval import retrieval_scores
from raycl.kmeans import l2_normalize

# Unit vectors whose cosines are exact in float32: 0 and 1 are a duplicate pair, 2 and 3 are
# mirror images (so any query on the x axis scores them the same: a tie).
TOY = np.array([[1.0, 0.0], [1.0, 0.0], [0.6, 0.8], [0.6, -0.8],
                [0.0, 1.0], [-1.0, 0.0], [-0.8, 0.6], [0.0, -1.0]])
TOY_LABELS = np.array([0, 0, 1, 0, 1, 2, 2, 1])


def sklearn_map(features: np.ndarray, labels: np.ndarray) -> float:
    """Mean of sklearn's AP per query over the rest of the set (queries with a positive)."""
    unit = l2_normalize(features)
    scores = []
    for query in range(len(labels)):
        others = np.delete(np.arange(len(labels)), query)
        relevant = labels[others] == labels[query]
        if relevant.any():
            scores.append(average_precision_score(relevant, unit[others] @ unit[query]))
    return float(np.mean(scores))


def test_toy_case_by_hand_and_against_sklearn() -> None:
    scores = retrieval_scores(TOY, TOY_LABELS, ks=(1, 5))
    # Top neighbour of each query (ties by index): 1, 0, 4, 7, 2, 6, 5, 3 -> queries 3 and 7 miss.
    assert scores["rank1"] == pytest.approx(6 / 8)
    # Query 7 ranks 3, then the tie {0, 1, 5}, then 6 before its class mates 2 and 4.
    assert scores["rank5"] == pytest.approx(7 / 8)
    # Per-query AP by hand; query 0 has its duplicate first, then the tie {2 (other), 3 (same)}.
    by_hand = [5 / 6, 5 / 6, 9 / 14, 2 / 3, 9 / 14, 1.0, 1.0, 19 / 84]
    assert scores["map"] == pytest.approx(np.mean(by_hand))
    assert scores["map"] == pytest.approx(sklearn_map(TOY, TOY_LABELS))
    assert list(scores) == ["rank1", "rank5", "map"]


def test_ties_rank_by_index_and_do_not_change_map() -> None:
    # The query's two neighbours tie; the lower index ranks first.
    features = np.array([[1.0, 0.0], [0.6, 0.8], [0.6, -0.8]])
    miss = retrieval_scores(features, np.array([0, 1, 0]), ks=(1,))
    hit = retrieval_scores(features, np.array([0, 0, 1]), ks=(1,))
    # The lone-label query is left out; query 0 takes 1 first (tie) and misses, 2 finds 0.
    assert miss["rank1"] == pytest.approx(1 / 2)
    # Query 0 takes 1 first and hits, 1 finds 0 (0.6 > -0.28); 2 is left out.
    assert hit["rank1"] == 1.0
    # sklearn groups the tie: AP of query 0 is 1/2 whichever item of the tie ranks first.
    assert miss["map"] == pytest.approx(sklearn_map(features, np.array([0, 1, 0])))


def test_query_is_excluded_by_index_but_its_duplicate_counts() -> None:
    features = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    # Each query's nearest other item is its duplicate, of another label: never itself.
    crossed = retrieval_scores(features, np.array([0, 1, 0, 1]), ks=(1,))
    assert crossed["rank1"] == 0.0
    # With matching labels the duplicate is the first hit.
    same = retrieval_scores(features, np.array([0, 0, 1, 1]), ks=(1,))
    assert same == {"rank1": 1.0, "map": 1.0}


def test_random_case_matches_sklearn_and_chunking() -> None:
    rng = np.random.default_rng(0)
    features = rng.normal(size=(200, 16))
    labels = rng.integers(0, 5, size=200)
    scores = retrieval_scores(features, labels)
    assert scores["map"] == pytest.approx(sklearn_map(features, labels), abs=1e-9)
    # rank-k by brute force (continuous features: no ties).
    unit = l2_normalize(features)
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, -np.inf)
    order = np.argsort(-similarity, axis=1)
    for k in (1, 5):
        expected = np.mean((labels[order[:, :k]] == labels[:, None]).any(axis=1))
        assert scores[f"rank{k}"] == pytest.approx(expected)
    chunked = retrieval_scores(features, labels, query_chunk=7)
    assert chunked == pytest.approx(scores)


def test_queries_without_a_class_mate_are_left_out() -> None:
    labels = TOY_LABELS.copy()
    labels[5] = 3  # query 5 is now alone in its class, and 6 too (class 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no positive class" warning as sklearn's would give
        scores = retrieval_scores(TOY, labels)
    assert scores["map"] == pytest.approx(sklearn_map(TOY, labels))
    kept = [q for q in range(8) if q not in (5, 6)]
    assert scores["rank1"] == pytest.approx(4 / len(kept))  # 3 and 7 still miss
    alone = retrieval_scores(TOY[:3], np.array([0, 1, 2]))
    assert all(np.isnan(value) for value in alone.values())


def test_k_beyond_the_split_means_the_whole_ranking() -> None:
    assert retrieval_scores(TOY, TOY_LABELS, ks=(50,))["rank50"] == 1.0


@pytest.mark.parametrize(
    ("features", "labels", "ks", "match"),
    [
        (np.zeros(4), np.zeros(4), (1,), "2-D"),
        (np.zeros((4, 2)), np.zeros(3), (1,), "one entry per feature row"),
        (np.zeros((1, 2)), np.zeros(1), (1,), "at least 2 samples"),
        (np.full((2, 2), np.nan), np.zeros(2), (1,), "finite"),
        (np.zeros((2, 2)), np.zeros(2), (0,), "integers >= 1"),
        (np.zeros((2, 2)), np.zeros(2), (), "non-empty"),
        (np.zeros((2, 2)), np.zeros(2), (1, 1), "distinct"),
    ],
)
def test_bad_inputs(
    features: np.ndarray, labels: np.ndarray, ks: tuple[int, ...], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        retrieval_scores(features, labels, ks=ks)
