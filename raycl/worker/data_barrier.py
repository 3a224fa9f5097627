"""The ranks of a trial wait for each other's data outside NCCL.

The first rank of a node that lacks its data cache builds it (:mod:`raycl.data.cache.build`):
for ImageNet, an hour or more on a worker's CPUs. The ranks of the other nodes, done loading,
would otherwise wait in the trial's first collective (DDP's broadcast of the weights), which
NCCL gives up on after its timeout (Ray Train's 30 minutes): the worker group restarts, which
kills the build, which starts over. :func:`data_barrier` makes every rank wait for the others'
data in a gloo group of its own with a timeout of :data:`DATA_WAIT` instead; the group is
created before the data is loaded, while every rank arrives together.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from raycl.distributed import barrier_after

# How long a rank waits for the slowest rank's data (a node building a cache of ImageNet on a
# few CPUs, from a slow shared file system).
DATA_WAIT = timedelta(hours=24)


@contextmanager
def data_barrier(timeout: timedelta = DATA_WAIT) -> Iterator[None]:
    """Run the body (the data loading), then wait until every rank has finished it, for up to
    ``timeout``, outside the default group (:func:`raycl.distributed.barrier_after`)."""
    with barrier_after(timeout):
        yield


__all__ = ["DATA_WAIT", "data_barrier"]
