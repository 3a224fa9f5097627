"""The data cache on a real cluster (issue 33, findings 7, 8 and 9): free disk checked before a
build, a cache never deleted under other nodes, a lock that works or a clear error, one listing
per dataset and node, decoding on the worker's CPUs (finding 12: tests/test_data_barrier.py)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from PIL import Image

from raycl.config.training import DataConfig
from raycl.data import ImageSet, load_dataset, load_image_set, split_sizes_for
from raycl.data.cache import build as build_module
from raycl.data.cache.build import build_cache
from raycl.data.cache.store import IMAGES_FILE, KEY_FILE, CacheError
from raycl.data.listed_once import listed_once

DiskUsage = namedtuple("DiskUsage", "total used free")


def _small_set() -> ImageSet:
    return ImageSet(images=np.full((4, 1, 32, 32), 5, np.uint8), labels={"d": np.arange(4)})


def _write_images(folder: Path, count: int, start: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(start, start + count):
        Image.fromarray(np.full((10, 10, 3), 20 * i % 256, np.uint8)).save(folder / f"{i}.JPEG",
                                                                           "JPEG")


def _settle(root: Path) -> None:
    """Every directory under ``root`` last changed a minute ago (the manifest keeps a listing
    only of a folder that did not change while it was listed)."""
    past = time.time() - 60
    for folder in [root, *(path for path in root.rglob("*") if path.is_dir())]:
        os.utime(folder, (past, past))


# --- 7: free disk ---------------------------------------------------------------------------------


def test_a_cache_larger_than_the_free_disk_is_refused_before_launch_and_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from raycl.tune import main

    root = tmp_path / "images"
    for name in ("a", "b"):
        _write_images(root / name, 10)
    cache = tmp_path / "cache"
    search = tmp_path / "full.yaml"
    search.write_text(f"name: full\ndata: {{dataset: folder, root: {root}, resolution: 16, "
                      f"loader: memory, cache_dir: {cache}}}\ntrain: {{batch_size: 4}}\n")
    # 20 images x 3 x 16 x 16 = 15 360 bytes: a disk with 1 kB free holds none of it.
    monkeypatch.setattr("shutil.disk_usage", lambda path: DiskUsage(10**12, 10**12, 1000))
    assert main([str(search), "--dry-run"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: {search}: data.cache_dir: the data cache of folder "
                               f"takes 0.0 GB decoded"), lines
    assert "GB free" in lines[0]
    # A job on a cluster is launched from its head, whose disk is not the workers': no verdict.
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.7:6379")
    assert main([str(search), "--dry-run"]) == 0
    capsys.readouterr()

    # Where the launch did not know (or another node's disk is fuller): the trial says so
    # before a byte is written, not with SIGBUS midway.
    decoded: list[Any] = []
    monkeypatch.setattr(build_module, "decode_square", lambda *args: decoded.append(args))
    cfg = DataConfig(dataset="folder", root=str(root), resolution=16, cache_dir=str(cache),
                     loader="memory", decode_workers=1)
    with pytest.raises(CacheError, match=r"^data.cache_dir: the data cache folder-\w+ takes "):
        load_image_set(cfg, seed=0)
    assert decoded == []
    assert not [path for path in cache.iterdir() if path.is_dir()], "nothing written"


# --- 8: never deleted under another node; locks ---------------------------------------------------


def test_a_cache_that_cannot_be_opened_is_left_in_place_unless_its_key_proves_it_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "cache" / "set-0"
    build_cache(directory, _small_set, {"k": 1}, resolution=2)
    images = directory / IMAGES_FILE
    whole = images.read_bytes()
    images.write_bytes(whole[: len(whole) // 2])  # another node's write, half visible here
    reads: list[int] = []

    def read() -> ImageSet:
        reads.append(1)
        return _small_set()

    monkeypatch.setattr(build_module, "OPEN_RETRY_SECONDS", 0.0, raising=False)
    with pytest.raises(CacheError, match=r"data.cache_dir: the data cache .*set-0 exists but "
                                         r"cannot be opened .*left in place"):
        build_cache(directory, read, {"k": 1}, resolution=2)
    assert reads == [] and images.read_bytes() == whole[: len(whole) // 2], "left as it was"

    # The file shows whole while the build waits to try again: opened, nothing rebuilt.
    sleeps: list[float] = []

    def wait(seconds: float) -> None:
        sleeps.append(seconds)
        images.write_bytes(whole)

    monkeypatch.setattr(build_module.time, "sleep", wait)
    opened = build_cache(directory, read, {"k": 1}, resolution=2)
    assert reads == [] and sleeps == [0.0] and opened.images.shape == (4, 1, 32, 32)

    # A permission this node lacks: not staleness either.
    real_load = np.load

    def denied(path: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(path).parent == directory:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_load(path, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(np, "load", denied)
        with pytest.raises(CacheError, match="Permission denied"):
            build_cache(directory, read, {"k": 1}, resolution=2)
    assert reads == [] and (directory / IMAGES_FILE).is_file()

    # key.json names another content: stale, removed and rebuilt.
    images.write_bytes(whole[: len(whole) // 2])
    (directory / KEY_FILE).write_text('{"k": 0}\n')
    rebuilt = build_cache(directory, read, {"k": 1}, resolution=2)
    assert reads == [1] and rebuilt.images.shape == (4, 1, 32, 32)


def test_no_working_lock_is_a_clear_error_and_two_builders_keep_the_first_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "cache" / "set-0"

    def no_locks(handle: Any, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(build_module.fcntl, "flock", no_locks)
    with pytest.raises(CacheError, match=r"data.cache_dir: .*cache has no working file locks "
                                         r"\(flock: No locks available\)"):
        build_cache(directory, _small_set, {"k": 1}, resolution=2)
    assert not directory.exists()

    # A lock that is not cluster-wide: another node builds the same set meanwhile; this build
    # keeps that node's cache instead of failing, and leaves that node's temporary directory.
    monkeypatch.setattr(build_module.fcntl, "flock", lambda handle, operation: None)
    other = directory.with_name("set-0.tmp-4242@other-node.abcd")
    other.mkdir()

    def read_while_another_node_builds() -> ImageSet:
        build_cache(directory, lambda: ImageSet(np.ones((3, 1, 2, 2), np.uint8), {}),
                    {"k": 1}, resolution=2)
        return _small_set()

    built = build_cache(directory, read_while_another_node_builds, {"k": 1}, resolution=2)
    assert built.images.shape == (3, 1, 2, 2), "the first cache renamed into place is kept"
    assert other.is_dir(), "another host's temporary directory is not this host's to remove"
    assert [path.name for path in directory.parent.iterdir() if ".tmp-" in path.name] == [
        other.name]


# --- 9: one listing per dataset and node; the worker's CPUs --------------------------------------


def _imagenet(tmp_path: Path) -> tuple[Path, DataConfig]:
    root = tmp_path / "imagenet"
    for wnid in ("n01", "n02"):
        _write_images(root / "train" / wnid, 6)
        _write_images(root / "val" / wnid, 2)
    _settle(root)
    cfg = DataConfig(dataset="imagenet", root=str(root), resolution=8, loader="memory",
                     cache_dir=str(tmp_path / "cache"), val_fraction=0.25, decode_workers=1)
    return root, cfg


def _trial(cfg: DataConfig, workers: int = 2) -> list[Any]:
    """What a trial reads: its process's split sizes, then each worker's data."""
    with listed_once():
        sizes = split_sizes_for(cfg)
    return [sizes, *(load_dataset(cfg, seed=0) for _ in range(workers))]


def test_a_built_cache_is_found_without_listing_the_dataset_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, cfg = _imagenet(tmp_path)
    first = _trial(cfg)  # the node's first trial lists (and builds)
    listings: list[str] = []
    for name in ("scandir", "listdir", "walk"):
        real = getattr(os, name)

        def spy(path: Any = ".", *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            if str(root) in str(path):
                listings.append(str(path))
            return _real(path, *args, **kwargs)

        monkeypatch.setattr(os, name, spy)
    second = _trial(cfg)
    assert listings == [], "a trial of a listed folder and a built cache lists nothing"
    assert second[0] == first[0]
    np.testing.assert_array_equal(np.asarray(second[1].train.images),
                                  np.asarray(first[1].train.images))

    # An image added to a class: the folder is listed again, its cache rebuilt with it.
    _write_images(root / "train" / "n01", 1, start=6)
    os.utime(root / "train" / "n01", (time.time() - 30, time.time() - 30))
    third = _trial(cfg, workers=1)
    assert listings, "a changed folder is listed again"
    assert sum(third[0].values()) == sum(first[0].values()) + 1
    assert len(third[1].train.images) + len(third[1].val.images) == 13


def test_the_builder_decodes_with_the_cpus_its_worker_reserved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    context = SimpleNamespace(get_assigned_resources=lambda: {"CPU": 2.0, "GPU": 1.0})
    fake_ray = SimpleNamespace(is_initialized=lambda: True, get_runtime_context=lambda: context)
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    pools: list[int] = []
    real_pool = build_module.ThreadPoolExecutor

    def pool(max_workers: int, **kwargs: Any) -> Any:
        pools.append(max_workers)
        return real_pool(max_workers=max_workers, **kwargs)

    monkeypatch.setattr(build_module, "ThreadPoolExecutor", pool)
    _, cfg = _imagenet(tmp_path)
    load_image_set(cfg.model_copy(update={"decode_workers": 0}), seed=0)
    assert pools == [2], "the worker's 2 reserved CPUs, not the node's 64 cores"
    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(is_initialized=lambda: False))
    assert build_module.decode_workers(0) == 64  # outside Ray: every core
    assert build_module.decode_workers(3) == 3


# --- Issue 46, 6: the listing itself kept once per node (stream workers, trial starts, PBT) -----

# A fresh process (a trial's worker, a PBT restart) loading the dataset as training does;
# prints how many directory listings it made under the dataset's root and the rows it got.
_LOADER = r"""
import json, os, sys
args = json.loads(sys.argv[1])
listed = []
for name in ("scandir", "listdir"):  # pathlib's iterdir and everything else that lists
    real = getattr(os, name)
    def spy(path=".", *rest, _real=real, **kwargs):
        if args["root"] in os.fsdecode(path):
            listed.append(os.fsdecode(path))
        return _real(path, *rest, **kwargs)
    setattr(os, name, spy)
if args["bucket"]:  # s3://<bucket>/... served from a local directory, every request counted
    import pyarrow.fs as pafs
    from raycl.data import bucket_paths
    from raycl.data.stream import shard_manifest
    local = pafs.SubTreeFileSystem(args["bucket"], pafs.LocalFileSystem())
    class Counted:
        def get_file_info(self, what):
            listed.append(str(getattr(what, "base_dir", what)))
            return local.get_file_info(what)
        def __getattr__(self, name):
            return getattr(local, name)
    counted = Counted()
    def from_uri(uri):
        return counted, uri.partition("?")[0].removeprefix("s3://")
    class Fs:
        FileSystem = type("FileSystem", (), {"from_uri": staticmethod(from_uri)})
        def __getattr__(self, name):
            return getattr(pafs, name)
    bucket_paths.fs = Fs()
    shard_manifest.launch_id = lambda: args["job"]  # the launch's Ray job
from raycl.config.training import DataConfig
from raycl.data import load_dataset
from raycl.data.registry import reader
cfg = DataConfig(**args["cfg"])
splits = load_dataset(cfg, seed=0)
key = reader(cfg.dataset).content_key(cfg, 0) if args["bucket"] else None
rows = {part: [str(path) for path in getattr(splits, part).images.paths]
        for part in ("train", "val", "test")}
print(json.dumps({"listed": len(listed), "rows": rows, "key": key}))
"""


def _load_in_a_new_process(cfg: DataConfig, watched: str, bucket: Path | None = None,
                           job: str | None = None) -> dict[str, Any]:
    args = {"cfg": cfg.model_dump(), "root": watched, "job": job,
            "bucket": str(bucket) if bucket else None}
    done = subprocess.run([sys.executable, "-c", _LOADER, json.dumps(args)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("dataset", ["imagenet", "folder"])
def test_a_second_process_streams_the_dataset_without_listing_it(
        tmp_path: Path, dataset: str) -> None:
    root, cfg = _imagenet(tmp_path)
    if dataset == "folder":  # its train/ half as a flat folder of two classes
        root, cfg = root / "train", cfg.model_copy(update={"dataset": "folder",
                                                           "root": str(root / "train")})
    cfg = cfg.model_copy(update={"loader": "stream"})
    first = _load_in_a_new_process(cfg, str(root))
    assert first["listed"] > 0, "the node's first process lists the folder"
    assert list((tmp_path / "cache").glob(f"{dataset}-files-*.json"))
    second = _load_in_a_new_process(cfg, str(root))
    assert second["listed"] == 0, "a later process (a worker, a trial, a PBT restart) reads " \
                                  "the node's listing"
    assert second["rows"] == first["rows"]

    # An image added to a class: its folder's time changed, so the folder is listed again.
    _write_images(root / ("n01" if dataset == "folder" else "train/n01"), 1, start=6)
    past = time.time() - 30
    os.utime(root / ("n01" if dataset == "folder" else "train/n01"), (past, past))
    third = _load_in_a_new_process(cfg, str(root))
    assert third["listed"] > 0
    assert sum(map(len, third["rows"].values())) == sum(map(len, first["rows"].values())) + 1
    assert _load_in_a_new_process(cfg, str(root))["listed"] == 0


def test_a_bucket_is_listed_once_per_node_and_launch(tmp_path: Path) -> None:
    store = tmp_path / "store"  # the bucket "raycl" is store/raycl/
    root, local_cfg = _imagenet(store / "raycl")
    uri = "s3://raycl/imagenet?endpoint_override=127.0.0.1:1&scheme=http"
    cfg = local_cfg.model_copy(update={"root": uri, "loader": "stream",
                                       "cache_dir": str(tmp_path / "cache")})
    first = _load_in_a_new_process(cfg, str(root), store, job="job-1")
    assert first["listed"] > 0
    second = _load_in_a_new_process(cfg, str(root), store, job="job-1")
    assert second["listed"] == 0, "the launch's other processes on the node make no request"
    assert second["rows"] == first["rows"] and second["key"] == first["key"]
    assert all(path.startswith("s3://raycl/imagenet/") and path.endswith("&scheme=http")
               for rows in second["rows"].values() for path in rows)
    # The next launch sees the bucket as it is now.
    assert _load_in_a_new_process(cfg, str(root), store, job="job-2")["listed"] > 0
