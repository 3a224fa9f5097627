"""Shards and buckets read once and reused (issue 33, findings 4 and 6), counted on a CPU: a
held-out split's captions read lazily by headers, never by every worker; one shard listing per
launch and per node; one file system client per bucket and process, with back-off on transient
errors; unreadable samples never stand in as copies or blank images, and past
``data.max_skipped_share`` fail the trial naming the files. No Ray."""

from __future__ import annotations

import io
import itertools
import json
import pickle
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs
import pytest
import torch
from data_fixtures import write_webdataset

from raycl.config.training import DataConfig
from raycl.data import bucket_paths
from raycl.data.listed_once import listed_once
from raycl.data.sources.sharded import WEBDATASET_READER, shard_split_sizes, shard_splits
from raycl.data.stream import shard_captions, shard_listing, shard_manifest, shard_samples
from raycl.data.stream.files import SkipBudget, TooManyUnreadable
from raycl.data.stream.shard_captions import ShardCaptions, present_captions
from raycl.data.stream.shards import Shard, ShardRows, shard_chunks_as_columns
from raycl.worker.embed import embed_images
from raycl.worker.evaluate import decodable_rows

SIDE = 8
IMAGE_BYTES = 256 * 2**10  # an image member: what a caption reader must not read


def data_cfg(root: Path, **extra: Any) -> DataConfig:
    return DataConfig(**{"dataset": "webdataset", "root": str(root), "val_fraction": 0.25,
                         "test_fraction": 0.25, "resolution": SIDE, **extra})


# --- Finding 6: one file system client per bucket and process, retries with back-off --------

class _Flaky:
    """A bucket's file system that fails its first ``failures`` reads with ``error``."""

    def __init__(self, inner: Any, failures: int, error: OSError) -> None:
        self.inner, self.failures, self.error = inner, failures, error

    def open_input_stream(self, path: str) -> Any:
        if self.failures > 0:
            self.failures -= 1
            raise self.error
        return self.inner.open_input_stream(path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def fake_s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``s3://<bucket>/<key>`` served from ``tmp_path/<bucket>/<key>`` through a counting
    ``FileSystem.from_uri``; ``slept``: the back-off's sleeps."""
    state: dict[str, Any] = {"from_uri": 0, "filesystem": None, "slept": []}
    local = pyarrow.fs.SubTreeFileSystem(str(tmp_path), pyarrow.fs.LocalFileSystem())

    def from_uri(uri: str) -> tuple[Any, str]:
        state["from_uri"] += 1
        return state["filesystem"] or local, uri.partition("?")[0].removeprefix("s3://")

    class Fs:  # pyarrow.fs with a counting from_uri (its FileSystem type is immutable)
        FileSystem = type("FileSystem", (), {"from_uri": staticmethod(from_uri)})

        def __getattr__(self, name: str) -> Any:
            return getattr(pyarrow.fs, name)

    monkeypatch.setattr(bucket_paths, "fs", Fs())
    monkeypatch.setattr(bucket_paths, "_sleep", state["slept"].append, raising=False)
    if hasattr(bucket_paths, "_CLIENTS"):  # this process's clients: none yet
        monkeypatch.setattr(bucket_paths, "_CLIENTS", {})
    for bucket in ("one", "two"):
        for number in range(4):
            (tmp_path / bucket / "dir").mkdir(parents=True, exist_ok=True)
            (tmp_path / bucket / "dir" / f"{number}.bin").write_bytes(bytes([number]) * 10)
    state["local"] = local
    return state


def test_one_filesystem_client_per_bucket_and_process(fake_s3: dict[str, Any]) -> None:
    query = "?endpoint_override=127.0.0.1:9&scheme=http"
    for bucket in ("one", "two"):
        for number in range(4):
            uri = f"s3://{bucket}/dir/{number}.bin{query}"
            assert bucket_paths.read_bytes(uri) == bytes([number]) * 10
            with bucket_paths.open_stream(uri) as stream:
                assert stream.read(1) == bytes([number])
    listed = bucket_paths.root_path(f"s3://one/dir{query}")
    assert [entry.name for entry in listed.iterdir()] == [f"{n}.bin" for n in range(4)]
    assert bucket_paths.read_bytes(listed.iterdir()[2]) == bytes([2]) * 10
    # Two buckets: two clients (not one per object read: 8 reads, 8 opens, 1 listing).
    assert fake_s3["from_uri"] == 2


def test_transient_errors_are_retried_with_back_off_others_raised_at_once(
        fake_s3: dict[str, Any]) -> None:
    slow_down = OSError("When reading information for key 'dir/0.bin' in bucket 'one': AWS "
                        "Error SLOW_DOWN during GetObject operation: Please reduce your "
                        "request rate.")
    fake_s3["filesystem"] = _Flaky(fake_s3["local"], 2, slow_down)
    assert bucket_paths.read_bytes("s3://one/dir/0.bin") == bytes(10)
    slept = fake_s3["slept"]
    assert len(slept) == 2 and 0.5 <= slept[0] <= 0.625 and 1.0 <= slept[1] <= 1.25

    slept.clear()
    bucket_paths._CLIENTS.clear()  # a new process: the next client is opened anew
    fake_s3["filesystem"] = _Flaky(fake_s3["local"], 1, FileNotFoundError("no such key"))
    with pytest.raises(FileNotFoundError):
        bucket_paths.read_bytes("s3://one/dir/1.bin")
    assert slept == []  # missing is not transient: no wait

    unavailable = OSError("AWS Error UNKNOWN (HTTP status 503) during GetObject operation")
    bucket_paths._CLIENTS.clear()
    fake_s3["filesystem"] = _Flaky(fake_s3["local"], 99, unavailable)
    with pytest.raises(OSError, match="HTTP status 503"):
        bucket_paths.open_stream("s3://one/dir/1.bin")
    assert len(slept) == bucket_paths.READ_ATTEMPTS - 1
    assert all(later > earlier for earlier, later in itertools.pairwise(slept))
    transient = ["Connection refused", "curlCode: 28, Timeout was reached",
                 "AWS Error NETWORK_CONNECTION", "HTTP status 500", "SlowDown"]
    assert all(bucket_paths.is_transient(OSError(text)) for text in transient)
    assert not bucket_paths.is_transient(OSError("AWS Error ACCESS_DENIED (HTTP status 403)"))
    assert not bucket_paths.is_transient(PermissionError("Connection refused"))


# --- Finding 4: held-out captions read lazily, by headers; one listing per launch and node ---

def _member(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


def write_big_shards(root: Path, shards: int = 4, per_shard: int = 3) -> None:
    """img2dataset's layout with large image members: ``<key>.jpg`` (random bytes),
    ``<key>.txt``, ``<key>.json``; a sample of shard 3 has only its json's caption."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for shard in range(shards):
        with tarfile.open(root / f"{shard:05d}.tar", "w") as archive:
            for position in range(per_shard):
                key, index = f"{shard:05d}{position:04d}", shard * per_shard + position
                _member(archive, f"{key}.jpg", rng.bytes(IMAGE_BYTES))
                if (shard, position) != (3, 1):
                    _member(archive, f"{key}.txt", f"sample {index}".encode())
                _member(archive, f"{key}.json", json.dumps({"caption": f"json {index}"}).encode())
    (root / "sizes.json").write_text(json.dumps({f"{n:05d}.tar": per_shard
                                                 for n in range(shards)}))


def test_held_out_captions_are_read_lazily_and_by_headers_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_big_shards(tmp_path / "wds")
    opened: list[str] = []
    stream, seekable = shard_samples.open_stream, shard_captions._open_seekable
    monkeypatch.setattr(shard_samples, "open_stream", lambda path: opened.append(path) or
                        stream(path))
    monkeypatch.setattr(shard_captions, "_open_seekable", lambda path: opened.append(path) or
                        seekable(path))
    splits = shard_splits(data_cfg(tmp_path / "wds"), seed=0)
    assert opened == []  # every worker loads the splits: none opens a shard for captions
    test = splits.test.captions
    assert isinstance(test, ShardCaptions) and len(test) == 3
    cut = test[np.array([0, 1])]  # the scoring's row cut: still nothing read
    assert opened == [] and pickle.loads(pickle.dumps(test)).stats.opened == 0

    assert present_captions(cut).tolist() == ["sample 9", "json 10"]
    assert opened == [str(tmp_path / "wds" / "00003.tar")]
    shard_size = (tmp_path / "wds" / "00003.tar").stat().st_size
    assert test.stats.opened == 1 and test.stats.bytes_read < shard_size / 10
    assert present_captions(splits.val.captions).tolist() == ["sample 6", "sample 7", "sample 8"]
    assert splits.train.captions is None


def test_shards_are_listed_once_per_launch_and_once_per_node_for_its_trials(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_webdataset(tmp_path / "wds", 4, 3, sizes="stats")  # a _stats.json GET per shard
    reads: list[str] = []
    read_bytes = shard_listing.read_bytes
    monkeypatch.setattr(shard_listing, "read_bytes", lambda path: reads.append(str(path)) or
                        read_bytes(path))
    cfg = data_cfg(tmp_path / "wds", cache_dir=str(tmp_path / "cache"))
    with listed_once():  # the launch's checks
        assert WEBDATASET_READER.check(cfg) is None
        assert WEBDATASET_READER.split_sizes(cfg) == {"train": 6, "val": 3, "test": 3}
        assert WEBDATASET_READER.class_counts(cfg) == {"all": [12]}
        WEBDATASET_READER.content_key(cfg, 0)
    assert len(reads) == 4  # one listing

    # A launch's trial process and its workers on one node: separate processes of one job.
    monkeypatch.setattr(shard_manifest, "launch_id", lambda: "job-1")
    reads.clear()
    assert shard_split_sizes(cfg)["train"] == 6  # the trial process
    for _ in range(3):  # its workers
        assert len(shard_splits(cfg, seed=0).val.images) == 3
    assert len(reads) == 4 and list((tmp_path / "cache" / "listings").glob("shards-*.json"))
    monkeypatch.setattr(shard_manifest, "launch_id", lambda: "job-2")  # the next launch
    shard_split_sizes(cfg)
    assert len(reads) == 8  # sees the dataset as it is now


# --- Finding 6: unreadable samples, never copies or blank images; the share fails the trial --

def test_unreadable_samples_over_the_share_fail_naming_the_files(tmp_path: Path) -> None:
    write_webdataset(tmp_path / "wds", 1, 8, bad={0: [1, 2]})
    shard = Shard(str(tmp_path / "wds" / "00000.tar"), 8, 0)
    columns = list(shard_chunks_as_columns(shard, "webdataset", SIDE, need_captions=False))
    skipped = sum(int(batch["skipped"].sum()) for batch in columns)
    names = [name for batch in columns for row in batch["skip_names"]
             for name in json.loads(str(row))]
    assert skipped == 2 and names == [f"{shard.path}:000000001", f"{shard.path}:000000002"]

    budget = SkipBudget(DataConfig().max_skipped_share, " on rank 0")  # 1 %
    budget.start(200)
    budget.add(names, skipped)  # 2 of 200: allowed
    with pytest.raises(TooManyUnreadable, match=r"data\.max_skipped_share: 3 of the 200 "
                                                r"samples.*on rank 0.*000000001"):
        budget.add(["s3://b/x.jpg"])
    budget.start(200)  # a new epoch starts from nothing
    budget.add(names)
    with pytest.raises(ValueError, match="max_skipped_share"):
        DataConfig(max_skipped_share=1.5)


class _Session:
    rank, world_size, device = 0, 1, torch.device("cpu")


def test_an_unreadable_shard_sample_is_never_scored_as_a_blank_image(tmp_path: Path) -> None:
    write_webdataset(tmp_path / "wds", 2, 4, bad={1: [2]})
    shards = [Shard(str(tmp_path / "wds" / f"0000{n}.tar"), 4, 4 * n) for n in range(2)]
    images = ShardRows(shards, "webdataset", SIDE)
    features = embed_images(torch.nn.Identity(), images, _Session(), batch_size=3,
                            embed=lambda batch: batch.flatten(1)[:, :4] + 1.0)
    assert np.isnan(features[6]).all() and np.isfinite(np.delete(features, 6, axis=0)).all()
    assert decodable_rows([{"val": features}])["val"].tolist() == [0, 1, 2, 3, 4, 5, 7]
    picked = images.subset(np.array([1, 6, 7]))  # a capped split: still shards, unread
    assert isinstance(picked, ShardRows) and len(picked) == 3
    marked = [decoded.rows for decoded in picked.decode_rows(0, 3, 2)]
    assert marked == [[1], []]
