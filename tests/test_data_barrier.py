"""Ranks wait for a node's cache build outside NCCL (issue 33, finding 12): a slow load on one
rank does not trip the default group's timeout (NCCL's 30 minutes in a trial). Its own module:
the spawned ranks import only torch and this file."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from fake_world import run_fake_world


def _barrier_worker(rank: int, init: str, out: str) -> None:
    from raycl.worker.data_barrier import data_barrier

    # The default group's timeout stands for NCCL's 30 minutes; rank 1's load for a long build
    # (twice that timeout: rank 0 waits past it in the barrier).
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=timedelta(seconds=2))
    with data_barrier():
        if rank == 1:
            time.sleep(4)
    total = torch.ones(1)
    dist.all_reduce(total)  # the trial's first collective (DDP's broadcast of the weights)
    Path(out, f"rank{rank}").write_text(str(int(total.item())))
    dist.destroy_process_group()


def test_ranks_wait_for_a_slow_build_outside_the_default_groups_timeout(tmp_path: Path) -> None:
    run_fake_world(_barrier_worker, (f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), 2)
    assert [(tmp_path / f"rank{rank}").read_text() for rank in range(2)] == ["2", "2"]
