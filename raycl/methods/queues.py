"""A global FIFO queue of embeddings (NNCLR's and All4One's support set, MoCo's negatives).

Three properties every user of the queue relies on, each tested:

- **Global under data parallelism.** :meth:`FeatureQueue.enqueue` gathers the entries from every
  rank before writing, so every rank holds the same queue (the distributed helpers are no-ops in
  a single process).
- **Checkpointed.** Entries, their sample indices and the write pointer are persistent buffers:
  ``state_dict()`` carries them, so a resumed or restarted trial keeps its support set (lightly's
  memory bank registers its bank with ``persistent=False``; a resume then starts from noise).
- **Any size.** Writes wrap around the end, so the queue size need not be a multiple of the
  global batch (solo-learn's ImageNet-100 config, 98 340 entries with batch 256, trips its own
  ``queue_size % batch_size == 0`` assertion); a batch larger than the queue keeps its last rows.

Callers look neighbours up *before* enqueueing the current batch, so a sample can never be its own
neighbour within its step (a sample's embedding from an earlier epoch may still be in the queue:
that is an older view of it, as in NNCLR).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raycl.distributed import gather_no_grad

KnnBackend = Literal["torch", "faiss"]


def cosine_topk(
    queries: Tensor, keys: Tensor, k: int, backend: KnnBackend = "torch"
) -> tuple[Tensor, Tensor]:
    """The ``k`` keys most cosine-similar to each query.

    ``torch`` is a matmul + ``topk`` on the keys' device; ``faiss`` is faiss's exact
    inner-product search on the host. Measured for one All4One step's lookups (2 x 256 queries,
    D = 256, k = 5) on 2 CPU cores, torch is 1.9x (16k keys) to 3.4x (98k keys) faster than
    ``faiss.knn`` (``docs/benchmarks.md``, "Support-set lookup"); on a GPU faiss-cpu would also copy
    the queue to the host. So torch is the default; faiss stays selectable for comparison.

    Args:
        queries: (B, D) query embeddings (normalised here).
        keys: (Q, D) keys, already L2-normalised (a :class:`FeatureQueue` stores them so).
        k: neighbours per query, 1 <= k <= Q.
        backend: ``torch`` or ``faiss``.

    Returns:
        ``(similarities, positions)``: (B, k) cosine similarities, descending, and the (B, k)
        int64 row positions in ``keys``, both on the queries' device.

    Raises:
        ValueError: on mismatched widths, ``k`` outside ``[1, Q]`` or an unknown backend.
    """
    if queries.dim() != 2 or keys.dim() != 2 or queries.shape[1] != keys.shape[1]:
        raise ValueError(f"queries (B, D) and keys (Q, D) must share D, got "
                         f"{tuple(queries.shape)} and {tuple(keys.shape)}")
    if not 1 <= k <= keys.shape[0]:
        raise ValueError(f"k must be in [1, {keys.shape[0]}] (the number of keys), got {k}")
    if backend not in ("torch", "faiss"):
        raise ValueError(f"backend must be 'torch' or 'faiss', got {backend!r}")
    with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
        return _cosine_topk(queries.detach().float(), keys.detach().float(), k, backend)


def _cosine_topk(
    queries: Tensor, keys: Tensor, k: int, backend: KnnBackend
) -> tuple[Tensor, Tensor]:
    """:func:`cosine_topk` on float32 inputs, autocast off: the similarities stay float32
    (ranking among close neighbours), and the float32 queue is not cast to half per lookup."""
    queries = F.normalize(queries, dim=1)
    if backend == "faiss":
        import faiss

        similarities, positions = faiss.knn(
            np.ascontiguousarray(queries.cpu().numpy()), np.ascontiguousarray(keys.cpu().numpy()),
            k, metric=faiss.METRIC_INNER_PRODUCT)
        return (torch.from_numpy(similarities).to(queries.device),
                torch.from_numpy(positions).to(queries.device))
    return (queries @ keys.T).topk(k, dim=1)


class FeatureQueue(nn.Module):
    """A FIFO queue of L2-normalised embeddings with the dataset index of each entry.

    It starts full of random unit vectors (index -1), as NNCLR's and MoCo's do, so lookups work
    from the first step; :meth:`fill` says how much of it holds real samples. With
    ``normalize=False`` it stores the rows as given and starts from zeros (FGVR's memory bank of
    raw feature vectors, read through :meth:`filled`).

    Args:
        size: number of entries Q, >= 1.
        dim: embedding width D, >= 1.
        backend: kNN backend of :meth:`nearest` (see :func:`cosine_topk`).
        normalize: L2-normalise rows on the way in (and start from random unit vectors).

    Example:
        >>> queue = FeatureQueue(size=98_304, dim=256)
        >>> neighbours, sample_index = queue.nearest(momentum_z1, k=5)  # look up first ...
        >>> queue.enqueue(momentum_z1, batch.index)  # ... then enqueue (every rank calls this)
    """

    embeddings: Tensor
    sample_index: Tensor
    pointer: Tensor

    def __init__(
        self, size: int, dim: int, backend: KnnBackend = "torch", normalize: bool = True
    ) -> None:
        super().__init__()
        if size < 1 or dim < 1:
            raise ValueError(f"queue size and dim must be >= 1, got {size} and {dim}")
        self.backend: KnnBackend = backend
        self.normalize = normalize
        # The global RNG is seeded identically on every rank before a method is built, so every
        # rank starts from the same noise.
        initial = F.normalize(torch.randn(size, dim), dim=1) if normalize else torch.zeros(size,
                                                                                         dim)
        self.register_buffer("embeddings", initial)
        self.register_buffer("sample_index", torch.full((size,), -1, dtype=torch.long))
        self.register_buffer("pointer", torch.zeros((), dtype=torch.long))
        # Rows written so far, capped at Q, kept on the host so :meth:`filled` needs no device
        # sync; None after a state-dict load until :meth:`filled` counts the restored rows once.
        self._rows_written: int | None = 0

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._rows_written = None  # counted from the loaded sample indices when next needed

    @property
    def size(self) -> int:
        return self.embeddings.shape[0]

    @torch.no_grad()
    def enqueue(self, embeddings: Tensor, sample_index: Tensor) -> None:
        """Writes the global batch's embeddings (gathered from every rank) at the pointer.

        Collective under DDP: every rank must call it, with the same batch size.

        Args:
            embeddings: (B_local, D) embeddings; stored as float32 (normalised first unless
                the queue was built with ``normalize=False``).
            sample_index: (B_local,) int64 dataset indices of the samples.
        """
        if embeddings.shape[0] != sample_index.shape[0]:
            raise ValueError(f"{embeddings.shape[0]} embeddings but {sample_index.shape[0]} "
                             f"sample indices")
        rows = gather_no_grad(embeddings.detach().float())
        if self.normalize:
            rows = F.normalize(rows, dim=1)
        index = gather_no_grad(sample_index.to(self.sample_index.device).long())
        if rows.shape[0] > self.size:  # only the newest Q survive a batch larger than the queue
            rows, index = rows[-self.size:], index[-self.size:]
        count = rows.shape[0]
        positions = (self.pointer + torch.arange(count, device=self.pointer.device)) % self.size
        self.embeddings[positions] = rows.to(self.embeddings.device)
        self.sample_index[positions] = index
        self.pointer.copy_((self.pointer + count) % self.size)
        if self._rows_written is not None:
            self._rows_written = min(self.size, self._rows_written + count)

    @torch.no_grad()
    def nearest(self, queries: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The ``k`` entries most cosine-similar to each query, nearest first.

        Args:
            queries: (B, D) query embeddings (normalised here).
            k: neighbours per query, 1 <= k <= Q.

        Returns:
            ``(neighbours, sample_index)``: (B, k, D) normalised entries (no gradient) and the
            (B, k) dataset indices they were enqueued with (-1: initial noise).
        """
        _, positions = cosine_topk(queries, self.embeddings, k, self.backend)
        positions = positions.to(self.embeddings.device)
        return self.embeddings[positions], self.sample_index[positions]

    def fill(self) -> Tensor:
        """Fraction of entries holding real samples (0-d tensor, no sync)."""
        return (self.sample_index >= 0).float().mean()

    def filled(self) -> Tensor:
        """The entries holding real samples, (n_filled, D), in storage order.

        Writes start at row 0 and wrap, so the filled rows are the first ``min(written, Q)``:
        a slice by a host-side count, not a boolean mask (whose size the host would have to
        read from the GPU every step). After a state-dict load the count is read once.
        """
        if self._rows_written is None:
            self._rows_written = int((self.sample_index >= 0).sum())
        return self.embeddings[: self._rows_written]


def queue_buffer_names(module: nn.Module) -> list[str]:
    """Fully qualified names of every :class:`FeatureQueue` buffer inside ``module``.

    Every rank updates these identically itself, so DDP need not broadcast them from rank 0 at
    every forward (for a 98k x 256 queue that would be 100 MB per step).
    """
    return [f"{prefix}.{name}" if prefix else name
            for prefix, child in module.named_modules() if isinstance(child, FeatureQueue)
            for name, _ in child.named_buffers(recurse=False)]


__all__ = ["FeatureQueue", "KnnBackend", "cosine_topk", "queue_buffer_names"]
