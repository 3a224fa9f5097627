"""Shared fixtures: one Ray session for the whole test run (start-up costs ~8 s)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ray_session(data_cache: Path):
    """Started after data_cache so that Ray's workers inherit RAYCL_CACHE."""
    import ray

    from raycl.tune import init_ray

    init_ray(num_cpus=2, include_dashboard=True, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread for a test of tiny models: fastest for them, and no oversubscription
    of a busy machine (two threads made All4One steps ~10x slower under load)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Datasets generated once per test run, shared by every test and Ray worker."""
    path = tmp_path_factory.mktemp("raycl-cache")
    os.environ["RAYCL_CACHE"] = str(path)
    return path
