"""Runs a function on a fake world of gloo processes (the losses' and the queue's DDP tests)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.multiprocessing as mp


def run_fake_world(worker: Callable[..., None], args: tuple[Any, ...], nprocs: int,
                   timeout: float = 60.0) -> None:
    """``worker(rank, *args)`` in ``nprocs`` spawned processes; fails the test if any process
    fails or they have not all finished within ``timeout`` seconds (then they are killed)."""
    context = mp.spawn(worker, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"distributed workers did not finish within {timeout:.0f} s")
