"""One decoded copy per node: the memory-mapped cache, its atomic and locked first build, parallel
decoding with progress, splits as views, and the training images kept on the device."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from raycl.config.training import DataConfig
from raycl.data import ImageFiles, ImageRows, ImageSet, load_dataset, load_image_set
from raycl.data.cache import build as build_module
from raycl.data.cache.build import build_cache
from raycl.data.cache.store import CACHE_VERSION, IMAGES_FILE, META_FILE, open_cached
from raycl.data.progress import Progress
from raycl.data.sources.trifeature import generate_trifeature
from raycl.data.splits import split_indices, stratified_split
from raycl.worker.resident import copy_to_device, keep_on_device, pretraining_images

REPO = Path(__file__).resolve().parents[1]


def data_cfg(cache: Path, **overrides: Any) -> DataConfig:
    """The data settings with small defaults (the schema's for every other key)."""
    fields: dict[str, Any] = dict(dataset="trifeature", resolution=8, samples_per_combination=1,
                                  val_fraction=0.1, test_fraction=0.2, cache_dir=str(cache),
                                  decode_workers=2)
    fields.update(overrides)
    return DataConfig(**fields)


def write_folder(root: Path, counts: dict[str, int], side: int = 12) -> list[Path]:
    """root/<class>/<i>.png, each image a flat colour unique to it; the paths in load order."""
    paths = []
    for class_index, (name, count) in enumerate(sorted(counts.items())):
        for i in range(count):
            path = root / name / f"{i:03d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((side, side, 3), (40 * class_index, 10 * i, 7),
                                    np.uint8)).save(path)
            paths.append(path)
    return paths


# --- the cache: a memory map -------------------------------------------------------------------


def test_the_cache_is_a_memory_map_that_reloads_equal(tmp_path: Path) -> None:
    cfg = data_cfg(tmp_path)
    first = load_image_set(cfg, seed=0)
    assert CACHE_VERSION == 3
    (directory,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    assert directory.name.startswith("trifeature-")
    assert {path.name for path in directory.iterdir()} == {IMAGES_FILE, META_FILE, "key.json"}
    # Read as a read-only map, not into memory; a plain np.load with mmap_mode reads it too.
    assert isinstance(first.images, np.memmap) and not first.images.flags.writeable
    mapped = np.load(directory / IMAGES_FILE, mmap_mode="r")
    assert mapped.shape == (1000, 3, 8, 8) and mapped.dtype == np.uint8
    fresh = generate_trifeature(samples_per_combination=1, resolution=8, seed=0)
    np.testing.assert_array_equal(mapped, fresh.images)
    again = open_cached(directory)
    assert again is not None
    np.testing.assert_array_equal(again.images, fresh.images)
    for name, values in fresh.labels.items():
        np.testing.assert_array_equal(again.labels[name], values)
    with np.load(directory / META_FILE, allow_pickle=False) as meta:  # no pickle needed
        assert sorted(meta.files) == ["attributes", "label_color", "label_shape",
                                      "label_texture"]


def test_an_incomplete_cache_directory_is_not_read(tmp_path: Path) -> None:
    image_set = ImageSet(images=np.zeros((4, 1, 2, 2), np.uint8),
                         labels={"digit": np.arange(4)}, test_mask=np.array([0, 0, 1, 1], bool))
    directory = tmp_path / "set"
    built = build_cache(directory, lambda: image_set, {"k": 1}, resolution=2)
    np.testing.assert_array_equal(built.test_mask, image_set.test_mask)
    assert built.captions is None and built.pretrain_only is None
    (directory / META_FILE).unlink()
    assert open_cached(directory) is None
    assert open_cached(tmp_path / "missing") is None


# --- splits are views, equal to the copies the old loader made -----------------------------------


def test_splits_are_views_equal_to_the_old_copies(tmp_path: Path) -> None:
    splits = load_dataset(data_cfg(tmp_path), seed=3)
    fresh = generate_trifeature(samples_per_combination=1, resolution=8, seed=3)
    train, val, test = stratified_split(fresh.labels["shape"], 0.2, 3, val_fraction=0.1)
    base = splits.train.images.base
    assert isinstance(base, np.memmap)
    for name, rows in (("train", train), ("val", val), ("test", test)):
        part = splits.split(name)
        assert isinstance(part.images, ImageRows) and part.images.base is base
        np.testing.assert_array_equal(part.images.rows, rows)
        np.testing.assert_array_equal(part.images, fresh.images[rows])
        for attribute, values in fresh.labels.items():
            np.testing.assert_array_equal(part.labels[attribute], values[rows])
    assert splits.pretrain_extra is None
    # What the loader before the memory map (main at 062a3cf) gave for this config and seed:
    # sizes, the first shape labels and the pixel sum of each split.
    old = {"train": ((700, 3, 8, 8), [3, 6, 5, 3, 6, 1, 7, 1], 2619194),
           "val": ((100, 3, 8, 8), [7, 4, 5, 0, 5, 6, 4, 6], 375959),
           "test": ((200, 3, 8, 8), [7, 1, 5, 7, 2, 7, 0, 7], 730139)}
    for name, (shape, labels, pixel_sum) in old.items():
        part = splits.split(name)
        assert part.images.shape == shape
        assert part.labels["shape"][:8].tolist() == labels
        assert int(np.asarray(part.images).astype(np.int64).sum()) == pixel_sum


def test_image_rows_read_only_the_rows_asked_for() -> None:
    base = np.arange(10 * 2 * 1 * 1, dtype=np.uint8).reshape(10, 2, 1, 1)
    view = ImageRows(base, np.array([7, 2, 3, 4, 9]))
    assert (view.shape, view.dtype, view.ndim, len(view)) == ((5, 2, 1, 1), np.uint8, 4, 5)
    assert view.nbytes == 10
    np.testing.assert_array_equal(view[0], base[7])
    np.testing.assert_array_equal(view[-1], base[9])
    np.testing.assert_array_equal(view[1:4], base[2:5])  # consecutive rows: one slice read
    np.testing.assert_array_equal(view[np.array([4, 0])], base[[9, 7]])
    np.testing.assert_array_equal(view[[True, False, False, False, True]], base[[7, 9]])
    np.testing.assert_array_equal(view[:, 1], base[[7, 2, 3, 4, 9], 1])
    np.testing.assert_array_equal(view[0, 1], base[7, 1])
    np.testing.assert_array_equal(np.stack(list(view)), base[[7, 2, 3, 4, 9]])
    np.testing.assert_array_equal(np.asarray(view), base[[7, 2, 3, 4, 9]])
    # Every read is a fresh, writable array: torch.from_numpy takes it without a warning.
    assert view[1:3].flags.writeable and not np.shares_memory(view[1:3], base)
    both = ImageRows(base, view.rows[:2]).concat(ImageRows(base, np.array([0])))
    np.testing.assert_array_equal(both, base[[7, 2, 0]])
    with pytest.raises(IndexError):
        view[5]
    with pytest.raises(ValueError, match="same base"):
        view.concat(ImageRows(base.copy(), np.array([0])))


def test_a_pickled_split_maps_the_same_file_instead_of_copying_it(tmp_path: Path) -> None:
    import pickle

    splits = load_dataset(data_cfg(tmp_path), seed=0)
    pickled = pickle.dumps(splits.train.images)
    assert len(pickled) < 2 * splits.train.images.rows.nbytes  # the rows, not 700 images
    restored = pickle.loads(pickled)
    assert isinstance(restored.base, np.memmap)
    assert restored.base.filename == splits.train.images.base.filename
    np.testing.assert_array_equal(restored, splits.train.images)
    in_memory = ImageRows(np.arange(4, dtype=np.uint8).reshape(4, 1, 1, 1), np.array([2]))
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(in_memory)), [[[[2]]]])


def _with_extra(count: int, extra_rows: list[int]) -> ImageSet:
    """Two classes alternating, the ``extra_rows`` unlabelled (-1) and pretraining-only."""
    labels = np.arange(count) % 2
    pretrain_only = np.zeros(count, bool)
    pretrain_only[extra_rows] = True
    labels[pretrain_only] = -1
    images = np.arange(count, dtype=np.uint8).reshape(count, 1, 1, 1)
    return ImageSet(images=images, labels={"class": labels}, pretrain_only=pretrain_only)


def test_pretrain_only_rows_go_to_pretrain_extra_and_no_split(tmp_path: Path,
                                                               monkeypatch) -> None:
    image_set = _with_extra(30, [0, 5, 11, 29])
    train, val, test, extra = split_indices(image_set, 0.1, 0.2, seed=0)
    np.testing.assert_array_equal(extra, [0, 5, 11, 29])
    labelled = np.concatenate([train, val, test])
    assert sorted(labelled.tolist()) == sorted(set(range(30)) - {0, 5, 11, 29})
    # The labelled rows are split as a set without the extra rows would be.
    pool = np.flatnonzero(~image_set.pretrain_only)
    expected = stratified_split(image_set.labels["class"][pool], 0.2, 0, val_fraction=0.1)
    for got, want in zip((train, val, test), expected, strict=True):
        np.testing.assert_array_equal(got, pool[want])

    class ExtraReader:
        def content_key(self, cfg: Any, seed: int) -> dict[str, Any]:
            return {"extra": 1}

        def read(self, cfg: Any, seed: int) -> ImageSet:
            return image_set

    monkeypatch.setattr("raycl.data.load.reader", lambda name: ExtraReader())
    splits = load_dataset(data_cfg(tmp_path, dataset="digits"), seed=0)
    assert splits.pretrain_extra is not None
    np.testing.assert_array_equal(splits.pretrain_extra.images[:, 0, 0, 0], [0, 5, 11, 29])
    # Pretraining sees train, then the extra rows: index i >= len(train) is an extra row.
    images = pretraining_images(splits)
    assert isinstance(images, ImageRows) and len(images) == len(splits.train.images) + 4
    np.testing.assert_array_equal(images[len(splits.train.images):, 0, 0, 0], [0, 5, 11, 29])
    np.testing.assert_array_equal(images[:len(splits.train.images)], splits.train.images)


# --- the first build: atomic, once, parallel, with progress --------------------------------------


def test_a_build_that_fails_halfway_leaves_no_cache_and_the_next_succeeds(
    tmp_path: Path, monkeypatch
) -> None:
    root = tmp_path / "images"
    write_folder(root, {"a": 6, "b": 6})
    cfg = data_cfg(tmp_path / "cache", dataset="folder", root=str(root), decode_workers=1)
    real = build_module.decode_square
    calls = []

    def crashing(path: Path, resolution: int) -> np.ndarray:
        calls.append(path)
        if len(calls) == 5:
            raise RuntimeError("the node ran out of something")
        return real(path, resolution)

    monkeypatch.setattr(build_module, "decode_square", crashing)
    with pytest.raises(RuntimeError, match="ran out"):
        load_image_set(cfg, seed=0)
    leftovers = [path.name for path in (tmp_path / "cache").iterdir() if path.is_dir()]
    assert leftovers == [], "neither a cache directory nor a temporary one is left"
    monkeypatch.setattr(build_module, "decode_square", real)
    built = load_image_set(cfg, seed=0)
    assert built.images.shape == (12, 3, 8, 8)


_BUILDER = """
import sys, time
from pathlib import Path
import numpy as np
from raycl.data import ImageSet
from raycl.data.cache.build import build_cache

directory, mode = Path(sys.argv[1]), sys.argv[2]

def read():
    Path(str(directory) + ".started").write_text("")
    if mode == "hang":
        time.sleep(120)
    return ImageSet(images=np.full((3, 1, 2, 2), 7, np.uint8), labels={"d": np.arange(3)})

build_cache(directory, read, {"k": 1}, resolution=2)
"""


def test_a_killed_builder_leaves_no_cache_and_the_next_build_cleans_up(tmp_path: Path) -> None:
    script = tmp_path / "builder.py"
    script.write_text(_BUILDER)
    directory = tmp_path / "cache" / "set-0"
    child = subprocess.Popen([sys.executable, str(script), str(directory), "hang"], cwd=REPO)
    started = Path(str(directory) + ".started")
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), "the builder never started reading"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert not directory.exists()
    assert list(directory.parent.glob("set-0.tmp-*")), "the dead builder's temporary directory"
    built = build_cache(directory, lambda: ImageSet(np.ones((2, 1, 2, 2), np.uint8), {}),
                        {"k": 1}, resolution=2)
    assert built.images.shape == (2, 1, 2, 2)  # the lock died with its holder
    assert not list(directory.parent.glob("set-0.tmp-*")), "removed by the next build"


_LOADER = """
import sys, time
from pathlib import Path
import numpy as np
from raycl.config.training import DataConfig
from raycl.data import load_image_set
from raycl.data.cache import build

root, cache, out, go = (Path(arg) for arg in sys.argv[1:5])
real = build.decode_square

def counting(path, resolution):
    with open(out.parent / "decodes.txt", "a") as log:
        log.write(f"{path.name}\\n")
    time.sleep(0.05)  # slow enough that the other process arrives while this one builds
    return real(path, resolution)

build.decode_square = counting
(out.parent / f"{out.name}.ready").write_text("")
while not go.exists():
    time.sleep(0.01)
cfg = DataConfig(dataset="folder", resolution=8, root=str(root), cache_dir=str(cache),
                 val_fraction=0.1, test_fraction=0.2, decode_workers=1)
np.save(out, np.asarray(load_image_set(cfg, seed=0).images))
"""


def test_two_processes_building_at_once_decode_once_and_agree(tmp_path: Path) -> None:
    root = tmp_path / "images"
    paths = write_folder(root, {"a": 5, "b": 5})
    script = tmp_path / "loader.py"
    script.write_text(_LOADER)
    go = tmp_path / "go"
    outs = [tmp_path / f"out{i}.npy" for i in range(2)]
    children = [subprocess.Popen([sys.executable, str(script), str(root), str(tmp_path / "c"),
                                  str(out), str(go)], cwd=REPO, stderr=subprocess.PIPE,
                                 text=True) for out in outs]
    try:
        deadline = time.monotonic() + 60
        while (not all(Path(f"{out}.ready").exists() for out in outs)
               and time.monotonic() < deadline):
            time.sleep(0.02)
        go.write_text("")  # both start loading at the same moment
        errors = [child.communicate(timeout=120)[1] for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    assert [child.returncode for child in children] == [0, 0], errors
    assert sum("decoding folder-" in error for error in errors) == 1, errors
    decoded = (tmp_path / "decodes.txt").read_text().split()
    assert sorted(decoded) == sorted(path.name for path in paths), "each file decoded once"
    first, second = (np.load(out) for out in outs)
    assert first.shape == (10, 3, 8, 8)
    np.testing.assert_array_equal(first, second)


def test_unreadable_images_are_all_counted_and_the_first_few_named(tmp_path: Path) -> None:
    """The build tries every file, then names the first three unreadable ones with why, how
    many more and how many in all, and leaves no cache; with data.skip_unreadable it keeps
    their rows blank and lists them beside the set (one cache for both settings)."""
    root = tmp_path / "images"
    write_folder(root, {"a": 3, "b": 3})
    (root / "a" / "001.png").write_bytes(b"not a png")
    (root / "b" / "000.png").write_bytes(b"")
    (root / "b" / "001.png").write_bytes(b"nope")
    (root / "b" / "002.png").write_bytes(b"nope")
    cfg = data_cfg(tmp_path / "cache", dataset="folder", root=str(root))
    with pytest.raises(ValueError) as info:
        load_image_set(cfg, seed=0)
    message = str(info.value)
    assert message.startswith(f"cannot read image {str(root / 'a' / '001.png')!r}: not an "
                              f"image Pillow can decode; {str(root / 'b' / '000.png')!r}: "
                              f"empty file; {str(root / 'b' / '001.png')!r}: ")
    assert str(root / "b" / "002.png") not in message and "\n" not in message
    assert message.endswith(" and 1 more (4 of 6 image files unreadable): set "
                            "data.skip_unreadable: true to leave them out")
    assert not [path for path in (tmp_path / "cache").iterdir() if path.is_dir()]
    kept = load_image_set(data_cfg(tmp_path / "cache", dataset="folder", root=str(root),
                                   skip_unreadable=True), seed=0)
    assert len(kept.images) == 6 and not np.asarray(kept.images)[[1, 3, 4, 5]].any()
    built = [path for path in (tmp_path / "cache").iterdir() if path.is_dir()]
    assert len(built) == 1 and (built[0] / "unreadable.json").is_file()


def test_decoding_runs_on_several_threads_and_reports_images_per_second(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    root = tmp_path / "images"
    paths = write_folder(root, {"a": 70, "b": 70})
    real = build_module.decode_square
    threads = set()

    def recording(path: Path, resolution: int) -> np.ndarray:
        import threading

        threads.add(threading.get_ident())
        return real(path, resolution)

    monkeypatch.setattr(build_module, "decode_square", recording)
    image_set = load_image_set(data_cfg(tmp_path / "cache", dataset="folder", root=str(root),
                                        decode_workers=3), seed=0)
    assert len(threads) >= 2  # 140 files in chunks of 64: more than one thread had work
    expected = np.stack([real(path, 8) for path in paths])
    np.testing.assert_array_equal(image_set.images, expected)  # every row where it belongs
    err = capsys.readouterr().err
    assert "decoding folder-" in err and "140 images in" in err and "images/s" in err


def test_progress_lines_on_a_log_and_on_a_terminal() -> None:
    log = io.StringIO()
    progress = Progress("decoding x", 100, stream=log, interval=0.0)
    progress.update(40)
    progress.close()
    first, last = log.getvalue().splitlines()
    assert first.startswith("decoding x: 40/100 images, ") and "images/s, ETA " in first
    assert last.startswith("decoding x: 40 images in ") and last.endswith("images/s")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    progress = Progress("decoding y", 10, stream=terminal, interval=0.0)
    progress.update(5)
    progress.close()
    text = terminal.getvalue()
    assert text.count("\r") == 2 and text.count("\n") == 1  # rewritten in place
    assert Progress("z", 1, stream=io.StringIO()).interval == 10.0  # a log: every 10 s


def test_a_shared_image_of_a_pairs_file_is_decoded_once(tmp_path: Path, monkeypatch) -> None:
    for i in range(2):
        Image.fromarray(np.full((6, 6, 3), 100 * i, np.uint8)).save(tmp_path / f"{i}.png")
    table = tmp_path / "pairs.csv"
    table.write_text("image,caption\n0.png,first\n1.png,other\n0.png,second\n")
    real = build_module.decode_square
    decoded = []
    monkeypatch.setattr(build_module, "decode_square", lambda path, resolution:
                        decoded.append(path.name) or real(path, resolution))
    image_set = load_image_set(data_cfg(tmp_path / "cache", dataset="pairs", root=str(table)),
                               seed=0)
    assert sorted(decoded) == ["0.png", "1.png"]
    np.testing.assert_array_equal(image_set.images[2], image_set.images[0])
    assert image_set.images[1].max() == 100 and image_set.images[0].max() == 0


def test_a_reader_returning_image_files_is_decoded_by_the_builder(tmp_path: Path) -> None:
    paths = write_folder(tmp_path / "images", {"a": 2})
    files = ImageFiles(paths=paths, labels={"class": np.zeros(2, np.int64)},
                       pretrain_only=np.array([False, True]))
    built = build_cache(tmp_path / "cache" / "x", lambda: files, {"k": 2}, resolution=4)
    assert built.images.shape == (2, 3, 4, 4)
    np.testing.assert_array_equal(built.pretrain_only, [False, True])
    with pytest.raises(ValueError, match=r"returned 1 labels\['class'\] for 2 images"):
        build_cache(tmp_path / "cache" / "y",
                    lambda: ImageFiles(paths=paths, labels={"class": np.zeros(1)}),
                    {"k": 3}, resolution=4)


# --- data.on_device -----------------------------------------------------------------------------


def test_on_device_decision_follows_the_setting_and_a_quarter_of_device_memory(
    monkeypatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=1000))
    cuda = torch.device("cuda", 0)
    assert keep_on_device("auto", 250, cuda) is True
    assert keep_on_device("auto", 251, cuda) is False
    assert keep_on_device(True, 10**12, cuda) is True
    assert keep_on_device(False, 1, cuda) is False
    for setting in ("auto", True, False):
        assert keep_on_device(setting, 1, torch.device("cpu")) is False  # ignored on CPU


def test_copy_to_device_copies_in_chunks(monkeypatch) -> None:
    monkeypatch.setattr("raycl.worker.resident.COPY_ROWS", 3)
    base = np.random.default_rng(0).integers(0, 256, (10, 3, 2, 2), dtype=np.uint8)
    view = ImageRows(base, np.array([9, 0, 4, 4, 1, 2, 8]))
    resident = copy_to_device(view, torch.device("cpu"))
    assert resident.dtype == torch.uint8
    np.testing.assert_array_equal(resident.numpy(), base[[9, 0, 4, 4, 1, 2, 8]])


def test_the_loader_indexes_views_and_device_tensors_alike() -> None:
    from raycl.worker.loader import IndexedImages, ResidentImages

    base = np.arange(8, dtype=np.uint8).reshape(8, 1, 1, 1)
    view = ImageRows(base, np.array([6, 1, 3, 5]))
    images, index = IndexedImages(view).__getitems__([3, 0])
    assert images[:, 0, 0, 0].tolist() == [5, 6] and index.tolist() == [3, 0]
    images, index = ResidentImages(torch.from_numpy(np.asarray(view))).__getitems__([3, 0])
    assert images[:, 0, 0, 0].tolist() == [5, 6] and index.tolist() == [3, 0]


def test_stages_with_pretraining_only_images_are_refused_in_the_worker(tmp_path: Path,
                                                                    monkeypatch) -> None:
    from raycl.worker.loader import trial_training_images

    monkeypatch.setattr("raycl.data.load.reader", lambda name: SimpleNamespace(
        content_key=lambda cfg, seed: {"x": 2}, read=lambda cfg, seed: _with_extra(20, [3])))
    splits = load_dataset(data_cfg(tmp_path, dataset="digits"), seed=0)
    config = SimpleNamespace(method="mcl", num_stages=2, data=SimpleNamespace(on_device="auto"))
    with pytest.raises(ValueError, match=r"data.pretrain_unlabeled: the stages' pseudo labels "
                                         r".* set data.pretrain_unlabeled: false"):
        trial_training_images(config, splits, torch.device("cpu"))


def test_decode_workers_zero_means_every_core_of_this_process() -> None:
    assert build_module.decode_workers(0) == len(os.sched_getaffinity(0))
    assert build_module.decode_workers(3) == 3


def test_the_memory_benchmark_runs_at_a_tiny_size(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "data_memory.py"), "30",
                             "--workdir", str(tmp_path)], cwd=REPO, capture_output=True,
                            text=True, timeout=300, check=True)
    table = result.stdout
    assert "| images | first build | load from cache |" in table
    assert "| 30 | " in table and "PSS summed" in table
