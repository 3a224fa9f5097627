"""Runs a function on a fake world of gloo processes (the losses' and the queue's DDP tests)."""

from __future__ import annotations

import os
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
    session (its gRPC threads) or a process group of its own, off Linux, or once autograd has
    started its device threads here (:func:`_autograd_forks`)."""
    ray = sys.modules.get("ray")
    if (not sys.platform.startswith("linux") or torch.distributed.is_initialized()
            or (ray is not None and ray.is_initialized()) or not _autograd_forks()):
        return "spawn"
    return "fork"


def _backward_once() -> None:
    torch.set_num_threads(1)  # the parent's OpenMP pool is not in a forked child
    try:
        torch.ones(1, requires_grad=True).sum().backward()
    except RuntimeError:
        os._exit(1)  # the answer is the exit code; no traceback on the test's stderr


def _autograd_forks() -> bool:
    """Whether a forked child of this process can run a backward. Not after a backward here
    once a fake tensor was used (torch.export, an earlier test's ``--register``): autograd then
    started its device threads and refuses to run in any forked child ("Unable to handle
    autograd's threading in combination with fork-based multiprocessing", pytorch wiki
    Autograd-and-Fork); no API says so, so a tiny child tries (milliseconds)."""
    child = mp.get_context("fork").Process(target=_backward_once)
    child.start()
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
        child.join()
    return child.exitcode == 0


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
