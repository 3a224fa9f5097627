"""Runs a function on a fake world of gloo processes (the losses' and the queue's DDP tests)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp


def _start_method() -> str:
    """``fork`` where it is safe, else ``spawn``. A spawned rank starts a new interpreter and
    imports torch and raycl again (~5 s of CPU each, ~70 s over the suite's fake worlds); a
    forked one starts from the test process's memory. Not forked: from a process with a Ray
    session (its gRPC threads) or a process group of its own, or off Linux."""
    ray = sys.modules.get("ray")
    if (not sys.platform.startswith("linux") or torch.distributed.is_initialized()
            or (ray is not None and ray.is_initialized())):
        return "spawn"
    return "fork"


def _forked_rank(rank: int, worker: Callable[..., None], *args: Any) -> None:
    # One intra-op thread: an OpenMP pool the parent started is not in a forked child, and a
    # parallel region of more than one thread would wait for it forever.
    torch.set_num_threads(1)
    worker(rank, *args)


def run_fake_world(worker: Callable[..., None], args: tuple[Any, ...], nprocs: int,
                   timeout: float = 60.0) -> None:
    """``worker(rank, *args)`` in ``nprocs`` processes (forked where safe, :func:`_start_method`);
    fails the test if any process fails or they have not all finished within ``timeout`` seconds
    (then they are killed)."""
    method = _start_method()
    if method == "fork":
        worker, args = _forked_rank, (worker, *args)
    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False,
                                 start_method=method)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"distributed workers did not finish within {timeout:.0f} s")
