"""Two ranks resume from the same checkpoint (issue 33, finding 11): rank 0 reads all of it and
chooses, rank 1 reads only its share of the one rank 0 chose, over a real gloo group. Its own
module: the spawned ranks import only this file's few imports."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import numpy as np
import ray.train
import torch
import torch.distributed as dist
from fake_world import run_fake_world


class _Session:
    """Rank ``rank`` of two, resuming from the newest ``root/checkpoint_*``."""

    device = torch.device("cpu")
    world_size = 2

    def __init__(self, root: Path, rank: int) -> None:
        self.root, self.rank = root, rank

    def latest_checkpoint(self) -> ray.train.Checkpoint:
        return ray.train.Checkpoint(str(sorted(self.root.glob("checkpoint_*"))[-1]))


def _restore_worker(rank: int, init: str, root: str, out: str) -> None:
    from raycl.worker.checkpoints import restore

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    restored = restore(_Session(Path(root), rank))  # type: ignore[arg-type]
    assert restored is not None
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "progress": restored.progress,
        "features": [sorted(stage) for stage in restored.inputs.features],
    }))
    dist.destroy_process_group()


def test_every_rank_resumes_from_the_checkpoint_rank_0_could_read(tmp_path: Path) -> None:
    """The newest checkpoint (stage 2 complete) has a truncated features.npz, a file only rank 0
    reads: rank 0 falls back to the one before, and rank 1, which could have read its share of
    the newest, resumes from that same one, without features."""
    from test_checkpoint_size import CLUSTERS, MCL, ROWS, SPLITS, stage_features, write_epoch

    from raycl.worker.stage_integration import FEATURES_FILE, StageInputs, next_stage_inputs

    root = tmp_path / "run"
    inputs = StageInputs()
    for stage in range(2):
        inputs = next_stage_inputs(MCL, inputs, stage_features(stage),  # type: ignore[arg-type]
                                   {}, np.arange(ROWS) % CLUSTERS)
    write_epoch(root, inputs, 1)
    newest, _ = write_epoch(root, inputs, 2, stage_complete=True)
    data = (newest / FEATURES_FILE).read_bytes()
    (newest / FEATURES_FILE).write_bytes(data[: len(data) // 2])

    run_fake_world(_restore_worker, (f"file://{tmp_path / 'rendezvous'}", str(root),
                                     str(tmp_path)), 2, timeout=120)
    got = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for report in got:
        assert report["progress"] == {"stage": 2, "phase": "train", "epoch": 1,
                                      "stage_complete": False}
    assert got[0]["features"] == [sorted(SPLITS)] * 2
    assert got[1]["features"] == [[], []]
