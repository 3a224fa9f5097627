"""Thread counts for rank 0's scoring: the CPUs its worker reserved, not Ray's default of one
(and full float32 precision for its matrix products).

Ray sets ``OMP_NUM_THREADS`` to a task's CPU count (1 unless the task asks for more) before a
worker imports anything, so faiss's OpenMP, the BLAS libraries and torch's intra-op pool all start
with one thread. :func:`scoring_threads` raises every one of them to the reservation
(``scaling.cpus_per_worker``) for the duration of the scoring and puts them back afterwards, so
the training step that follows runs as it did before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import faiss
import torch


def reserved_threads(cpus_per_worker: float) -> int:
    """Threads for a worker that reserved ``cpus_per_worker`` CPUs (at least one; a fraction
    of a CPU rounds down)."""
    return max(1, int(cpus_per_worker))


@contextmanager
def scoring_threads(count: int) -> Iterator[int]:
    """Run the body with ``count`` threads in faiss (OpenMP), torch (intra-op) and every BLAS
    threadpoolctl finds (numpy's OpenBLAS, faiss's); restore each one's count on exit.

    Args:
        count: threads to use, >= 1.

    Yields:
        ``count``.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    torch_before = torch.get_num_threads()
    faiss_before = faiss.omp_get_max_threads()
    with ExitStack() as stack:
        try:
            # Optional: without it only the BLAS behind torch and faiss follow ``count``.
            from threadpoolctl import threadpool_limits
        except ImportError:  # pragma: no cover - threadpoolctl comes with scikit-learn
            pass
        else:
            # ``threadpool_limits`` sets (not only caps) each library's count, and restores
            # the previous counts when the stack closes.
            stack.enter_context(threadpool_limits(limits=count))
        torch.set_num_threads(count)
        faiss.omp_set_num_threads(count)
        try:
            yield count
        finally:
            torch.set_num_threads(torch_before)
            faiss.omp_set_num_threads(faiss_before)


@contextmanager
def exact_float32_matmul() -> Iterator[None]:
    """Run the body with IEEE float32 matrix products: the worker allows TF32 on CUDA for
    training (:mod:`raycl.worker.cuda`), whose 10-bit mantissa would reorder near neighbours."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


__all__ = ["exact_float32_matmul", "reserved_threads", "scoring_threads"]
