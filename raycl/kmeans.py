"""K-means clustering and MCL pseudo labels.

MCL (Multistage Contrastive Learning) clusters the embeddings of every finished stage and
uses the tuple of all previous cluster assignments as the pseudo label of the next stage
(paper Eq. 2). We store that tuple as a single int64 mixed-radix code so it can travel in a
tensor (`Batch.pseudo_labels`) and be compared with `==` in the masked loss.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

# faiss tries its CPU builds in turn and logs each miss at INFO ("Could not load library with
# AVX512 support"): noise in every Ray Train worker, whose root logger Ray sets to INFO.
logging.getLogger("faiss.loader").setLevel(logging.WARNING)
import faiss  # noqa: E402

if TYPE_CHECKING:
    import torch

_INT64_MAX = np.iinfo(np.int64).max
# Rows per block where a whole-array temporary would double rank 0's memory at scale.
ROW_BLOCK = 65_536


def kmeans_gpu(device: torch.device | None) -> int | None:
    """The GPU faiss k-means may run on: the CUDA device the calling process trains on (in a Ray
    worker, the one Ray assigned it), when faiss can use GPUs; None (the CPU) otherwise.

    Never "every GPU faiss sees": a process that holds no GPU (the trial process, a CPU worker)
    must not take one, and rank 0 sees its peers' GPUs, which their training occupies.
    """
    if device is None or device.type != "cuda" or faiss.get_num_gpus() == 0:
        return None
    if device.index is not None:
        return device.index
    import torch

    return torch.cuda.current_device()


def kmeans(
    features: np.ndarray,
    k: int,
    seed: int,
    niter: int = 50,
    normalize: bool = True,
    gpu: int | None = None,
    max_points: int | None = None,
) -> np.ndarray:
    """Cluster feature rows with faiss k-means.

    Args:
        features: (N, D) array of embeddings (any float dtype; converted to float32).
        k: number of clusters, 1 <= k <= N.
        seed: faiss random seed; the same seed and input give the same assignments.
        niter: number of Lloyd iterations.
        normalize: L2-normalise rows before clustering, as the MCL authors' public code does
            (k-means on unit vectors approximates clustering by cosine similarity, which is
            the geometry the contrastive loss shapes).
        gpu: run on this one GPU (a CUDA device index, see :func:`kmeans_gpu`); None: the CPU.
        max_points: fit the centroids on at most this many rows (a subset faiss draws with
            ``seed``); None fits on every row. Every row is assigned either way.

    Returns:
        int64 array (N,) of cluster ids in [0, k).
    """
    features = np.asarray(features)
    if features.ndim != 2:
        raise ValueError(f"features must be 2-D (N, D), got shape {features.shape}")
    num_samples, dim = features.shape
    if num_samples == 0 or dim == 0:
        raise ValueError(f"features must be non-empty, got shape {features.shape}")
    if not 1 <= k <= num_samples:
        raise ValueError(f"k must satisfy 1 <= k <= N={num_samples}, got k={k}")
    if niter < 1:
        raise ValueError(f"niter must be >= 1, got {niter}")
    if not all_finite(features):
        raise ValueError("features contain NaN or inf")

    data = np.ascontiguousarray(features, dtype=np.float32)
    if normalize:
        data = l2_normalize(data)
    clustering = fit_kmeans(data, k, seed, niter, gpu, max_points)
    _, assignments = clustering.index.search(data, 1)
    return assignments.reshape(-1).astype(np.int64)


def fit_kmeans(
    data: np.ndarray,
    k: int,
    seed: int,
    niter: int = 50,
    gpu: int | None = None,
    max_points: int | None = None,
) -> faiss.Kmeans:
    """The trained faiss k-means on float32 rows (see :func:`kmeans` for the arguments)."""
    if max_points is not None and max_points < k:
        raise ValueError(f"max_points must be >= k={k}, got {max_points}")
    if gpu is not None and not 0 <= gpu < faiss.get_num_gpus():
        raise ValueError(f"gpu={gpu} but faiss sees {faiss.get_num_gpus()} GPU(s) "
                         "(is faiss-gpu installed?)")
    # faiss fits on k * max_points_per_centroid rows (default 256 per centroid: 512 of 4 000
    # rows for K=2); MCL's pseudo labels should come from all of them unless capped.
    cap = len(data) if max_points is None else min(max_points, len(data))
    clustering = faiss.Kmeans(
        data.shape[1],
        k,
        niter=niter,
        seed=seed,
        gpu=False,  # faiss's gpu= takes the first n GPUs; one chosen GPU is set below
        verbose=False,
        max_points_per_centroid=math.ceil(cap / k),
        # Small datasets are legitimate here (tests, tiny HPO trials); the default of 39
        # points per centroid only triggers a warning, so silence it.
        min_points_per_centroid=1,
    )
    if gpu is None:
        clustering.train(data)
    else:
        _train_on_gpu(clustering, data, gpu)
    return clustering


def _train_on_gpu(clustering: faiss.Kmeans, data: np.ndarray, gpu: int) -> None:
    """Train ``clustering`` with its index on GPU ``gpu`` only, after handing PyTorch's cached
    blocks back to the driver (faiss allocates outside PyTorch's caching allocator)."""
    import torch

    torch.cuda.empty_cache()
    with torch.cuda.device(gpu):  # CUDA calls outside faiss's own land here, not on GPU 0
        clustering.index = faiss.index_cpu_to_gpus_list(faiss.IndexFlatL2(data.shape[1]),
                                                        gpus=[gpu])
        clustering.train(data)


def l2_normalize(features: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """Return float32 rows scaled to unit L2 norm (all-zero rows stay zero).

    Args:
        features: (N, D) array.
        eps: floor on the norm so zero rows do not divide by zero.

    Returns:
        Contiguous float32 (N, D) array.
    """
    data = np.asarray(features, dtype=np.float32)
    # Row norms a block at a time: np.linalg.norm squares its whole input first, a second
    # (N, D) array beside the result at ImageNet scale; per row the values are the same.
    norms = np.empty((len(data), 1), dtype=np.float32)
    for start in range(0, len(data), ROW_BLOCK):
        norms[start:start + ROW_BLOCK] = np.linalg.norm(data[start:start + ROW_BLOCK], axis=1,
                                                        keepdims=True)
    return np.ascontiguousarray(data / np.maximum(norms, eps))


def all_finite(features: np.ndarray) -> bool:
    """Whether every value of ``features`` is finite, checked a block of rows at a time (no
    (N, D) mask)."""
    return all(bool(np.isfinite(features[start:start + ROW_BLOCK]).all())
               for start in range(0, len(features), ROW_BLOCK))


def pseudo_label_codes(
    assignments: Sequence[np.ndarray], k: int, num_samples: int | None = None
) -> np.ndarray:
    """Encode the tuple of all previous stage assignments as one mixed-radix integer.

    code = (...((y_0) * K + y_1) * K + ...) * K + y_{j-1}, i.e. stage 0 is the most
    significant digit. Two samples get the same code iff they agree in *every* previous
    stage, which is exactly the pseudo label of paper Eq. 2. (The authors' public CLIP code
    means to do this but a loop-variable slip encodes only the latest stage; we follow the
    paper and encode all stages.)

    Args:
        assignments: per-stage int arrays (N,), in stage order, values in [0, k).
            Empty for stage 0, which has a single group (all codes 0).
        k: number of clusters per stage (the radix).
        num_samples: N. Required when `assignments` is empty (nothing else tells N);
            otherwise checked against the assignments' length if given.

    Returns:
        int64 array (N,) of codes in [0, k**len(assignments)).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if num_samples is not None and num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if len(assignments) == 0:
        if num_samples is None:
            raise ValueError("no assignments (stage 0): pass num_samples to get all-zero codes")
        return np.zeros(num_samples, dtype=np.int64)
    if k ** len(assignments) - 1 > _INT64_MAX:
        raise ValueError(
            f"k**stages = {k}**{len(assignments)} does not fit in int64; too many stages"
        )
    stages = [np.asarray(stage) for stage in assignments]
    expected = len(stages[0]) if num_samples is None and stages[0].ndim == 1 else num_samples
    for stage_index, stage in enumerate(stages):
        if expected is None or stage.shape != (expected,):
            raise ValueError(
                f"assignments[{stage_index}] must be 1-D of length {expected}, "
                f"got shape {stage.shape}"
            )
        if not np.issubdtype(stage.dtype, np.integer):
            raise ValueError(f"assignments[{stage_index}] must be integer, got {stage.dtype}")
        if stage.size and (stage.min() < 0 or stage.max() >= k):
            raise ValueError(f"assignments[{stage_index}] has values outside [0, {k})")
    codes = np.zeros(expected, dtype=np.int64)
    for stage in stages:
        codes = codes * k + stage.astype(np.int64)
    return codes


def group_sizes(codes: np.ndarray) -> dict[int, int]:
    """Number of samples per pseudo-label group.

    Args:
        codes: int array (N,) of pseudo-label codes.

    Returns:
        {code: count}, ordered by code, only non-empty groups.
    """
    codes = np.asarray(codes)
    if codes.ndim != 1:
        raise ValueError(f"codes must be 1-D, got shape {codes.shape}")
    values, counts = np.unique(codes, return_counts=True)
    return {int(value): int(count) for value, count in zip(values, counts, strict=True)}


def group_size_histogram(codes: np.ndarray) -> np.ndarray:
    """Group sizes sorted largest first, for logging the long tail (paper Fig. on sizes).

    Args:
        codes: int array (N,) of pseudo-label codes.

    Returns:
        int64 array of group sizes in descending order.
    """
    sizes = np.fromiter(group_sizes(codes).values(), dtype=np.int64)
    return np.sort(sizes)[::-1]


def ami_matrix(assignments: Sequence[np.ndarray]) -> np.ndarray:
    """Adjusted mutual information between every pair of stage clusterings (paper Tab. 11).

    Low off-diagonal values mean each stage clustered the data by something new.

    Args:
        assignments: S per-stage label arrays of equal length N.

    Returns:
        (S, S) float64 symmetric matrix with ones on the diagonal.
    """
    stages = [np.asarray(stage) for stage in assignments]
    for stage_index, stage in enumerate(stages):
        if stage.ndim != 1 or stage.shape[0] != stages[0].shape[0]:
            raise ValueError(
                f"assignments[{stage_index}] must be 1-D with the same length as "
                f"assignments[0], got shape {stage.shape}"
            )
    from sklearn.metrics import adjusted_mutual_info_score  # ~1 s to import: only when used

    num_stages = len(stages)
    matrix = np.eye(num_stages, dtype=np.float64)
    for row in range(num_stages):
        for col in range(row + 1, num_stages):
            value = float(adjusted_mutual_info_score(stages[row], stages[col]))
            matrix[row, col] = matrix[col, row] = value
    return matrix


def check_stage_budget(
    k: int,
    stages: int,
    num_samples: int,
    batch_size: int,
    count_final_clustering: bool = False,
) -> str | None:
    """Check that the last stage's pseudo-label groups can still fill batches.

    The paper (Sec. 4.1, Eq. 4) states the constraint as K^N <= M / b, counting the K^N
    tuples that N clusterings can produce. But stage j is trained with the labels of stages
    0..j-1 only, so the last training stage (j = N-1) batches over at most K^(N-1) groups;
    the clustering after the final stage is a diagnostic that never drives a sampler. We
    therefore enforce K^(N-1) <= M / b by default, i.e. the mean group size of the last
    stage is at least one batch. Evidence that this is the paper's intended reading: its
    own CLIP setting (K=10, four stages, b=8192, ~10M CC12M pairs) violates K^N <= M/b
    (10^4 > ~1.2e3) but satisfies K^(N-1) <= M/b. Pass `count_final_clustering=True` to
    enforce the paper's literal (K times stricter) K^N form instead.

    Either way this is a necessary condition on the *mean* group size; k-means groups are
    long-tailed, so some groups may still be smaller than a batch. The sampler pools such
    leftovers instead of dropping them.

    Args:
        k: clusters per stage (K).
        stages: number of training stages (N), including stage 0.
        num_samples: training-set size (M).
        batch_size: global batch size (b).
        count_final_clustering: use the paper's literal exponent N instead of N-1.

    Returns:
        None when the configuration is fine, otherwise a human-readable description of the
        problem (suitable for pruning an HPO trial).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")

    if batch_size > num_samples:
        return f"batch_size={batch_size} exceeds the number of training samples M={num_samples}"
    exponent = stages if count_final_clustering else stages - 1
    num_groups = k**exponent  # Python int: no overflow for large exponents
    # Integer form of num_groups <= M / b, avoiding float rounding.
    if num_groups * batch_size > num_samples:
        return (
            f"K^{exponent} = {k}^{exponent} = {num_groups} pseudo-label groups exceed "
            f"M/b = {num_samples}/{batch_size} = {num_samples / batch_size:.1f}: groups in "
            f"the last stage would on average be smaller than one batch "
            f"(reduce K, stages or batch size)"
        )
    return None
