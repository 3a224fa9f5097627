"""``data.loader`` settled once, carried as a type: the launch resolves ``auto``, the worker
builds its loader's kind from that choice alone, and every kind (memory, on-device, stream
files, stream shards) yields the same typed batch record."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from data_fixtures import write_webdataset
from test_end_to_end import tiny_config
from test_stream import CLASSES, PER_CLASS, write_folder

from raycl.data import load_dataset
from raycl.data.load import settled_loader
from raycl.launch.placement import data_cpus
from raycl.methods import build_method
from raycl.sweep.run import settle_loader
from raycl.worker.batches import TrainBatch
from raycl.worker.loader import (
    DeviceImages,
    HostImages,
    StreamedFiles,
    StreamedShards,
    build_loader,
    trial_training_images,
)
from raycl.worker.resident import pretraining_images
from raycl.worker.stage_integration import StageInputs

CPU = torch.device("cpu")


class _Session:
    rank, world_size, device = 0, 1, CPU


def test_auto_is_settled_at_launch_and_reaches_the_worker_unchanged(
    data_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """On nodes too small for the decoded folder the launch streams it, says so once, and the
    data, the decoders' reservation and the worker's loader all follow that choice without
    deciding again; the same config never launched (a bare call) reads the set whole."""
    folder = write_folder(tmp_path / "images")
    config = tiny_config(tmp_path, "quickstart.yaml", "data.dataset=folder",
                         f"data.root={folder}", "data.resolution=16", "train.batch_size=16",
                         "data.stream_cpus=0.5")
    assert config.data.loader == "auto"
    decoded = CLASSES * PER_CLASS * 3 * 16 * 16
    monkeypatch.setattr("raycl.sweep.run.smallest_node_memory", lambda _config: float(decoded))
    settled = settle_loader(config)
    assert settled.data.loader == "stream"
    assert capsys.readouterr().out.count("raycl: data.loader auto -> stream (") == 1

    def measured_again(*args: Any) -> None:
        raise AssertionError("auto's size rule asked again after the launch")

    monkeypatch.setattr("raycl.data.load.decoded_bytes", measured_again)
    assert settled_loader(settled.data) == "stream"
    assert data_cpus(settled) == 0.5
    data = load_dataset(settled.data, settled.seed)
    assert isinstance(trial_training_images(settled, data, CPU), StreamedFiles)
    # Never launched: auto with no node measured reads a set that can be read whole.
    assert data_cpus(config) == 0.0
    bare = load_dataset(config.data, config.seed)
    assert isinstance(trial_training_images(config, bare, CPU), HostImages)


def test_memory_and_on_device_kinds_yield_typed_batches(
    data_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host rows and device-resident images: the sampler's batches as TrainBatch records, the
    rows the index names, no captions (a set's captions go by index, tokenised once)."""
    config = tiny_config(tmp_path, "quickstart.yaml", "train.batch_size=16",
                         "train.loader_workers=0")
    data = load_dataset(config.data, config.seed)
    everything = torch.from_numpy(np.asarray(pretraining_images(data)))
    host = trial_training_images(config, data, CPU)
    monkeypatch.setattr("raycl.worker.loader.keep_on_device", lambda *args: True)
    resident = trial_training_images(config, data, CPU)
    assert isinstance(host, HostImages) and isinstance(resident, DeviceImages)
    for kind in (host, resident):
        loader = build_loader(config, kind, StageInputs(), _Session())
        loader.set_epoch(1)
        batches = list(loader)
        assert len(batches) == len(loader) == len(everything) // 16
        for batch in batches:
            assert isinstance(batch, TrainBatch) and batch.captions is None
            assert batch.images.dtype == torch.uint8 and len(batch.index) == 16
            assert torch.equal(batch.images, everything[batch.index])
        assert loader.pop_metrics() == {}  # no pseudo-label groups without MCL's sampler


def test_shard_kind_yields_typed_batches_with_and_without_captions(
    ray_session: Any, tmp_path: Path
) -> None:
    """Shards streamed for an image-text method carry each batch's captions, aligned with its
    images; read without captions the record says None."""
    write_webdataset(tmp_path / "wds", shards=4, per_shard=8)
    config = tiny_config(tmp_path, "quickstart.yaml", "method=clip", "data.dataset=webdataset",
                         f"data.root={tmp_path / 'wds'}", "data.loader=stream",
                         "data.resolution=12", "train.batch_size=4", "data.val_fraction=0.25",
                         "data.test_fraction=0.25", "data.stream_cpus=0", "tune.search_space={}",
                         "tune.metric=val/i2t/r1")
    kind = trial_training_images(config, load_dataset(config.data, config.seed), CPU)
    assert isinstance(kind, StreamedShards)
    clip = build_method(config, in_channels=3)
    for need_captions in (True, False):
        loader = build_loader(config, kind, StageInputs(), _Session(),
                              need_captions=need_captions)
        loader.set_epoch(0)
        batches = list(loader)
        assert len(batches) == len(loader) == 16 // 4
        for batch in batches:
            assert isinstance(batch, TrainBatch) and batch.images.shape == (4, 3, 12, 12)
            # Training shards come first: a row's index is its sample's, which its caption names.
            expected = [f"sample {i}" for i in batch.index.tolist()] if need_captions else None
            assert batch.captions == expected
            # Tokenised by the decoders (issue 33, 13d): CLIP's own tokens, none in training.
            assert (torch.equal(batch.tokens, clip.tokenize(expected)) if need_captions
                    else batch.tokens is None)
        assert loader.pop_metrics() == {"data/skipped": 0.0}
