"""CIFAR-10/100, STL-10, ImageNet and ImageNet-100 read from the formats they are distributed in
(tiny copies written by tests/data_fixtures.py), through the code a user runs: load_dataset,
split_sizes_for, and the config checks that name a bad file before launch."""

from __future__ import annotations

import pickle
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from data_fixtures import (
    CIFAR_SIDE,
    STL10_SIDE,
    class_colour,
    dump_python2_pickle,
    imagenet100_wnids,
    stl10_bytes,
    write_cifar10,
    write_cifar100,
    write_imagenet,
    write_stl10,
)

from raycl.config.schema import ConfigError, DataConfig
from raycl.data import load_dataset, load_image_set, split_sizes_for
from raycl.data.registry import SOURCES, reader
from raycl.data.sources.shipped import StackedImages, download_if_missing
from raycl.data.types import Reader
from raycl.launch.checks import check_pretrain_unlabeled
from raycl.launch.load import load_search

REPO = Path(__file__).resolve().parents[1]
WNIDS = ["n01558993", "n02869837", "n01749939"]  # sorted: n01558993, n01749939, n02869837


def data_config(tmp_path: Path, dataset: str, root: Path, **fields: Any) -> DataConfig:
    return DataConfig(dataset=dataset, root=str(root), cache_dir=str(tmp_path / "cache"),
                      **{"resolution": 16, "val_fraction": 0.2, **fields})


def assert_problem(dataset: str, cfg: DataConfig, pattern: str) -> None:
    """The reader's pre-launch check finds a problem of data.root whose line matches
    ``pattern``."""
    problem = reader(dataset).check(cfg)
    assert problem is not None and problem.key == "root", problem
    assert re.search(pattern, problem.why), problem.why


def split_lengths(splits: Any) -> dict[str, int]:
    return {name: len(splits.split(name).images) for name in ("train", "val", "test")}


def image_bytes(images: Any) -> set[bytes]:
    return {np.asarray(image).tobytes() for image in np.asarray(images)}


def assert_class_colours(image_set: Any, tolerance: float,
                         colour_of: dict[int, np.ndarray] | None = None) -> None:
    """Each image has the fixture's colour of its label (its class's, or ``colour_of[label]``):
    images and labels stayed together from the file to the split."""
    images, labels = np.asarray(image_set.images), image_set.labels["class"]
    means = images.reshape(len(images), 3, -1).mean(axis=2)
    expected = np.stack([class_colour(int(label)) if colour_of is None
                         else colour_of[int(label)] for label in labels])
    assert np.abs(means - expected).max() < tolerance


# --- CIFAR ------------------------------------------------------------------------------------

def test_cifar10_splits_are_the_shipped_files(tmp_path: Path) -> None:
    root = write_cifar10(tmp_path / "data", per_class_train=5, per_class_test=2)
    cfg = data_config(tmp_path, "cifar10", root, resolution=32)
    splits = load_dataset(cfg, seed=0)
    assert split_lengths(splits) == {"train": 40, "val": 10, "test": 20} == split_sizes_for(cfg)
    assert splits.num_classes == {"class": 10} and splits.attributes == ["class"]
    with open(root / "cifar-10-batches-py" / "test_batch", "rb") as handle:
        test_batch = pickle.load(handle, encoding="bytes")
    shipped = test_batch[b"data"].reshape(-1, 3, CIFAR_SIDE, CIFAR_SIDE)
    assert image_bytes(splits.test.images) == image_bytes(shipped)
    for split in ("train", "val", "test"):
        assert_class_colours(splits.split(split), tolerance=12)


def test_cifar_pixel_order_round_trips(tmp_path: Path) -> None:
    """A hand-made image in CIFAR's byte order (1 024 red values row by row, then green, then
    blue) reads back as (channel, row, column)."""
    root = write_cifar10(tmp_path / "data", per_class_train=1, per_class_test=1)
    image = np.zeros((3, CIFAR_SIDE, CIFAR_SIDE), dtype=np.uint8)
    row = np.zeros(3 * CIFAR_SIDE * CIFAR_SIDE, dtype=np.uint8)
    for channel in range(3):
        for y in range(CIFAR_SIDE):
            for x in range(CIFAR_SIDE):
                value = channel * 80 + y * 2 + (x > y)  # asymmetric in rows and columns
                image[channel, y, x] = value
                row[channel * 1024 + y * 32 + x] = value
    path = root / "cifar-10-batches-py" / "data_batch_1"
    with open(path, "rb") as handle:
        batch = pickle.load(handle, encoding="bytes")
    batch[b"data"] = np.concatenate([row[None], batch[b"data"][1:]])
    dump_python2_pickle(batch, path)
    images = load_image_set(data_config(tmp_path, "cifar10", root, resolution=32), seed=0).images
    np.testing.assert_array_equal(np.asarray(images[0]), image)


def test_cifar10_root_may_be_the_batches_directory(tmp_path: Path) -> None:
    root = write_cifar10(tmp_path / "data")
    parent = load_image_set(data_config(tmp_path, "cifar10", root), seed=0)
    itself = load_image_set(data_config(tmp_path, "cifar10", root / "cifar-10-batches-py"), 0)
    assert np.asarray(parent.images).shape == (50, 3, 16, 16)
    np.testing.assert_array_equal(np.asarray(parent.images), np.asarray(itself.images))


def test_cifar100_has_fine_and_coarse_labels(tmp_path: Path) -> None:
    root = write_cifar100(tmp_path / "data", per_class_train=1, per_class_test=1)
    cfg = data_config(tmp_path, "cifar100", root, val_fraction=0.01)
    splits = load_dataset(cfg, seed=0)
    assert splits.attributes == ["fine", "coarse"]
    assert splits.num_classes == {"fine": 100, "coarse": 20}
    assert split_lengths(splits) == {"train": 100, "val": 0, "test": 100} == split_sizes_for(cfg)
    for split in ("train", "test"):
        labels = splits.split(split).labels
        assert sorted(labels["fine"]) == list(range(100))
        np.testing.assert_array_equal(labels["coarse"], labels["fine"] // 5)


def test_every_reader_implements_the_whole_protocol(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch's data check and split sizes call every method of every reader without
    asking whether it is there; a source with no file has nothing to check."""
    methods = {name for name, value in vars(Reader).items()
               if callable(value) and not name.startswith("_")}
    assert methods == {"content_key", "read", "check", "class_counts", "split_sizes"}
    for dataset in SOURCES:
        source = reader(dataset)
        missing = [name for name in methods if not callable(getattr(type(source), name, None))]
        assert not missing, (dataset, missing)
    assert reader("trifeature").check(DataConfig()) is None
    assert reader("digits").check(DataConfig(dataset="digits")) is None
    absent = tmp_path / "fashion-mnist"
    monkeypatch.setattr("raycl.data.sources.packaged.FASHION_MNIST_DIR", absent)
    assert reader("mnist_fashion").check(DataConfig(dataset="mnist_fashion")) == (
        "dataset", f"mnist_fashion needs Fashion-MNIST in {absent} (Debian package "
                   f"dataset-fashion-mnist)")
    assert split_sizes_for(DataConfig(samples_per_combination=1)) == {
        "train": 700, "val": 100, "test": 200}


def test_cifar_without_its_batches_is_one_line(tmp_path: Path) -> None:
    root = write_cifar10(tmp_path / "data")
    directory = root / "cifar-10-batches-py"
    (directory / "data_batch_3").unlink()
    (directory / "test_batch").unlink()
    cfg = data_config(tmp_path, "cifar10", root)
    assert_problem("cifar10", cfg,
                   r"^\S+cifar-10-batches-py lacks data_batch_3, "
                   r"test_batch of the CIFAR-10 python batches$")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_problem("cifar100", data_config(tmp_path, "cifar100", empty),
                   r"neither it nor .*cifar-100-python/ has train, test")


def test_a_pickle_that_would_run_code_is_refused(tmp_path: Path) -> None:
    root = write_cifar10(tmp_path / "data")

    class Exploit:
        def __reduce__(self) -> tuple[Any, ...]:
            return (shutil.rmtree, (str(tmp_path / "data"),))

    path = root / "cifar-10-batches-py" / "data_batch_2"
    path.write_bytes(pickle.dumps({b"data": Exploit()}, protocol=2))
    with pytest.raises(ValueError, match=r"data_batch_2 is not a CIFAR python pickle: "
                                         r"unexpected object shutil\.rmtree"):
        load_image_set(data_config(tmp_path, "cifar10", root), seed=0)
    assert path.exists()


def test_download_asks_torchvision_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchvision.datasets

    calls: list[dict[str, Any]] = []

    class FakeCIFAR10:
        def __init__(self, **kwargs: Any) -> None:
            calls.append(kwargs)
            write_cifar10(Path(kwargs["root"]))

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", FakeCIFAR10)
    root = tmp_path / "data"
    cfg = data_config(tmp_path, "cifar10", root, download=True)
    assert reader("cifar10").check(cfg) is None  # nothing missing yet: it will be downloaded
    assert len(load_image_set(cfg, seed=0).images) == 50
    load_dataset(cfg, seed=1)
    assert calls == [{"root": str(root), "train": True, "download": True}]
    assert_problem("cifar10", data_config(tmp_path, "cifar10", tmp_path / "other"),
                   r"other does not exist \(expected the CIFAR-10")


def test_processes_downloading_at_once_download_once(tmp_path: Path) -> None:
    """Workers of one node starting together: one downloads, the others wait for its files."""
    calls: list[Path] = []

    def download(parent: Path) -> None:
        calls.append(parent)
        time.sleep(0.2)  # the others arrive while this one downloads
        write_cifar10(parent)

    cfg = data_config(tmp_path, "cifar10", tmp_path / "data", download=True)
    names = ["data_batch_1", "test_batch"]
    threads = [threading.Thread(target=download_if_missing,
                                args=(cfg, "cifar-10-batches-py", names, download))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [tmp_path / "data"]


# --- STL-10 -----------------------------------------------------------------------------------

def test_stl10_pretrains_on_unlabeled_and_train(tmp_path: Path) -> None:
    root = write_stl10(tmp_path / "data", per_class_train=3, per_class_test=2, unlabeled=20)
    cfg = data_config(tmp_path, "stl10", root, val_fraction=0.01)
    splits = load_dataset(cfg, seed=0)
    assert split_lengths(splits) == {"train": 30, "val": 0, "test": 20} == split_sizes_for(cfg)
    assert splits.pretrain_extra is not None and len(splits.pretrain_extra.images) == 20
    assert (splits.pretrain_extra.labels["class"] == -1).all()
    assert sorted(splits.test.labels["class"]) == sorted(np.repeat(np.arange(10), 2))
    for split in ("train", "test"):  # labels 1..10 in the file are classes 0..9 of the images
        assert_class_colours(splits.split(split), tolerance=12)
    labelled = data_config(tmp_path, "stl10", root, val_fraction=0.01, pretrain_unlabeled=False)
    assert load_dataset(labelled, seed=0).pretrain_extra is None


def test_stl10_images_read_upright(tmp_path: Path) -> None:
    """A hand-made image in STL-10's byte order (each channel column by column) reads back the
    right way up: row y of channel 0 is y, column x of channel 1 is x, a mark at the top left."""
    root = write_stl10(tmp_path / "data", per_class_train=1, per_class_test=1, unlabeled=1)
    y, x = np.mgrid[0:STL10_SIDE, 0:STL10_SIDE]
    mark = np.where((y < 10) & (x < 30), 200, 0)
    image = np.stack([y, x, mark]).astype(np.uint8)
    side = STL10_SIDE
    stored = bytearray(3 * side * side)
    for channel in range(3):
        for column in range(side):
            for row in range(side):
                stored[channel * side * side + column * side + row] = image[channel, row, column]
    train_x = root / "stl10_binary" / "train_X.bin"
    train_x.write_bytes(bytes(stored) + train_x.read_bytes()[len(stored):])
    assert bytes(stored) == stl10_bytes(image[None])  # the fixture writes the same order
    cfg = data_config(tmp_path, "stl10", root, resolution=STL10_SIDE)
    np.testing.assert_array_equal(np.asarray(load_image_set(cfg, seed=0).images[0]), image)


def test_stl10_missing_unlabeled_names_the_way_out(tmp_path: Path) -> None:
    root = write_stl10(tmp_path / "data", with_unlabeled=False)
    cfg = data_config(tmp_path, "stl10", root)
    assert_problem("stl10", cfg,
                   r"stl10_binary lacks unlabeled_X\.bin, which "
                   r"pretraining .* set data\.pretrain_unlabeled: false$")
    assert reader("stl10").check(data_config(tmp_path, "stl10", root,
                                             pretrain_unlabeled=False)) is None
    (root / "stl10_binary" / "test_y.bin").unlink()
    assert_problem("stl10", cfg,
                   r"stl10_binary lacks test_y\.bin, unlabeled_X\.bin of "
                   r"the STL-10 binary files$")


def test_stl10_truncated_file_is_named(tmp_path: Path) -> None:
    root = write_stl10(tmp_path / "data")
    train_x = root / "stl10_binary" / "train_X.bin"
    train_x.write_bytes(train_x.read_bytes()[:-5])
    assert_problem("stl10", data_config(tmp_path, "stl10", root),
                   r"train_X\.bin is \d+ bytes, not a whole number")


def test_stl10_download_asks_torchvision(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import torchvision.datasets

    calls: list[dict[str, Any]] = []

    class FakeSTL10:
        def __init__(self, **kwargs: Any) -> None:
            calls.append(kwargs)
            write_stl10(Path(kwargs["root"]))

    monkeypatch.setattr(torchvision.datasets, "STL10", FakeSTL10)
    root = tmp_path / "data"
    assert len(load_image_set(data_config(tmp_path, "stl10", root, download=True), 0).images) \
        == 70
    assert [call["split"] for call in calls] == ["train+unlabeled", "test"]
    assert all(call["download"] is True and call["root"] == str(root) for call in calls)


# --- ImageNet ---------------------------------------------------------------------------------

def test_imagenet_val_is_the_test_split(tmp_path: Path) -> None:
    root = write_imagenet(tmp_path / "imagenet", WNIDS, per_class_train=5, per_class_val=2)
    cfg = data_config(tmp_path, "imagenet", root, resolution=8)
    splits = load_dataset(cfg, seed=0)
    assert split_lengths(splits) == {"train": 12, "val": 3, "test": 6} == split_sizes_for(cfg)
    assert splits.num_classes == {"class": 3}
    assert sorted(splits.test.labels["class"]) == [0, 0, 1, 1, 2, 2]
    # Class indices follow the sorted wnids: each decoded image has its class's colour.
    for split in ("train", "test"):
        assert_class_colours(splits.split(split), tolerance=20)


def test_imagenet_val_class_without_training_images(tmp_path: Path) -> None:
    root = write_imagenet(tmp_path / "imagenet", WNIDS, per_class_train=1, per_class_val=1)
    shutil.rmtree(root / "train" / "n02869837")
    assert_problem("imagenet", data_config(tmp_path, "imagenet", root),
                   r"class folder\(s\) 'n02869837' of \S+/val have no "
                   r"images in \S+/train")


def test_imagenet_unsorted_val_is_explained(tmp_path: Path) -> None:
    root = write_imagenet(tmp_path / "imagenet", WNIDS, per_class_train=1, per_class_val=1)
    for image in list((root / "val").rglob("*.JPEG")):
        image.rename(root / "val" / image.name)
        image.parent.rmdir()
    assert_problem("imagenet", data_config(tmp_path, "imagenet", root),
                   r"val/ holds no <wnid>/ folders: sort")


def test_imagenet100_list_is_cmc_s() -> None:
    wnids = imagenet100_wnids()
    assert len(wnids) == len(set(wnids)) == 100
    assert wnids[:3] == ["n02869837", "n01749939", "n02488291"] and wnids[-1] == "n02090622"
    assert all(len(wnid) == 9 and wnid[0] == "n" and wnid[1:].isdigit() for wnid in wnids)


def test_imagenet100_reads_its_classes_from_a_full_root(tmp_path: Path) -> None:
    wnids = imagenet100_wnids()
    other = "n09999999"  # a class of the full ImageNet outside the list: not read
    root = write_imagenet(tmp_path / "imagenet", [*wnids, other], per_class_train=1,
                          per_class_val=1, size=8)
    cfg = data_config(tmp_path, "imagenet100", root, resolution=8, val_fraction=0.01)
    splits = load_dataset(cfg, seed=0)
    assert split_lengths(splits) == {"train": 100, "val": 0, "test": 100} == split_sizes_for(cfg)
    assert splits.num_classes == {"class": 100}
    # The colour written for wnid w (index among all 101 sorted) is the one read for its class.
    written = {wnid: i for i, wnid in enumerate(sorted([*wnids, other]))}
    read_index = {wnid: i for i, wnid in enumerate(sorted(wnids))}
    colour_of = {read_index[wnid]: class_colour(index) for wnid, index in written.items()
                 if wnid in read_index}
    assert_class_colours(splits.test, tolerance=25, colour_of=colour_of)


def test_imagenet100_missing_classes_are_named(tmp_path: Path) -> None:
    wnids = imagenet100_wnids()
    root = write_imagenet(tmp_path / "imagenet", wnids[:93], per_class_train=1,
                          per_class_val=1, size=8)
    shutil.rmtree(root / "val" / wnids[0])
    missing_train = sorted(wnids[93:])
    missing_val = sorted([wnids[0], *wnids[93:]])
    expected = (f"lacks classes of ImageNet-100's list (imagenet100.txt): 7 in train/: "
                f"{', '.join(missing_train[:5])} (+2 more); 8 in val/: "
                f"{', '.join(missing_val[:5])} (+3 more)")
    problem = reader("imagenet100").check(data_config(tmp_path, "imagenet100", root))
    assert problem == ("root", f"{root} {expected}")


# --- Before launch: FILE: key: why -----------------------------------------------------------

SEARCH = """
name: t
method: {METHOD}
data: {DATA}
train: {epochs: 1, batch_size: 4}
tune: {num_samples: 1}
"""


def search_error(tmp_path: Path, data: str, method: str = "simclr") -> str:
    path = tmp_path / "search.yaml"
    path.write_text(textwrap.dedent(SEARCH).replace("{DATA}", data).replace("{METHOD}", method))
    with pytest.raises(ConfigError) as info:
        load_search(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_files_fail_the_config_naming_file_and_key(tmp_path: Path) -> None:
    source = tmp_path / "search.yaml"
    cifar = write_cifar10(tmp_path / "cifar")
    (cifar / "cifar-10-batches-py" / "data_batch_5").unlink()
    assert search_error(tmp_path, f"{{dataset: cifar10, root: {cifar}}}") == (
        f"{source}: data.root: {cifar}/cifar-10-batches-py lacks data_batch_5 of the CIFAR-10 "
        f"python batches")
    stl = write_stl10(tmp_path / "stl", with_unlabeled=False)
    assert search_error(tmp_path, f"{{dataset: stl10, root: {stl}}}").startswith(
        f"{source}: data.root: {stl}/stl10_binary lacks unlabeled_X.bin")
    imagenet = write_imagenet(tmp_path / "imagenet", WNIDS, per_class_train=1, per_class_val=1)
    assert search_error(tmp_path, f"{{dataset: imagenet100, root: {imagenet}}}").startswith(
        f"{source}: data.root: {imagenet} lacks classes of ImageNet-100's list (imagenet100.txt)"
        f": 97 in train/: ")
    assert search_error(tmp_path, "{dataset: cifar100}") == (
        f"{source}: data.root: dataset 'cifar100' needs data.root (the directory its files are "
        f"in, or its parent)")


def test_mcl_on_stl10_leaves_out_the_unlabeled_images(tmp_path: Path) -> None:
    stl = write_stl10(tmp_path / "stl")
    message = search_error(tmp_path, f"{{dataset: stl10, root: {stl}}}", method="mcl")
    assert message == (f"{tmp_path / 'search.yaml'}: data.pretrain_unlabeled: MCL's pseudo "
                       f"labels cover the labelled training images only; set "
                       f"data.pretrain_unlabeled: false")
    path = tmp_path / "search.yaml"
    path.write_text(textwrap.dedent(SEARCH).replace("{METHOD}", "mcl").replace(
        "{DATA}", f"{{dataset: stl10, root: {stl}, pretrain_unlabeled: false}}"))
    config = load_search(path, check_references=False)
    assert list(check_pretrain_unlabeled(config)) == []


def test_stacked_images_index_like_the_concatenated_array() -> None:
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 256, (count, 3, 4, 4), dtype=np.uint8) for count in (3, 0, 5)]
    whole = np.concatenate(parts)
    stacked = StackedImages(parts, resolution=4)
    assert stacked.shape == whole.shape and len(stacked) == 8 and stacked.dtype == np.uint8
    for key in (slice(None), slice(2, 6), slice(1, 8, 3), slice(5, 2)):
        np.testing.assert_array_equal(stacked[key], whole[key])
    for index in (0, 4, -1):
        np.testing.assert_array_equal(stacked[index], whole[index])
    picks = np.array([7, 0, 3, 3, -2])
    np.testing.assert_array_equal(stacked[picks], whole[picks])
    np.testing.assert_array_equal(stacked[whole[:, 0, 0, 0] > 128], whole[whole[:, 0, 0, 0] > 128])
    np.testing.assert_array_equal(np.asarray(stacked), whole)
    with pytest.raises(IndexError):
        stacked[8]
    # Resized rows equal the resize of the whole array's rows.
    small = StackedImages(parts, resolution=2)
    np.testing.assert_array_equal(small[picks], StackedImages([whole[picks]], 2)[:])


def test_cli_refuses_a_cifar_directory_without_its_batches(tmp_path: Path) -> None:
    cifar = write_cifar10(tmp_path / "cifar")
    for name in ("data_batch_1", "data_batch_2"):
        (cifar / "cifar-10-batches-py" / name).unlink()
    search = REPO / "searches" / "quickstart.yaml"
    done = subprocess.run([sys.executable, "-m", "raycl.tune", str(search), "--set",
                           "data.dataset=cifar10", "--set", f"data.root={cifar}"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: {search}: data.root: {cifar}/cifar-10-batches-py lacks data_batch_1, "
        f"data_batch_2 of the CIFAR-10 python batches"]
    assert not (tmp_path / "ray_results").exists() and not (tmp_path / "mlflow.db").exists()


def test_a_shipped_dataset_is_a_transfer_set_on_its_own_train_and_test_files(
        tmp_path: Path) -> None:
    from raycl.config.search_config import search_config_class
    from raycl.eval.transfer import load_transfer_sets

    stl = write_stl10(tmp_path / "stl", per_class_train=2, per_class_test=1, unlabeled=5)
    config = search_config_class().model_validate({
        "name": "t", "data": {"dataset": "digits", "resolution": 16,
                              "cache_dir": str(tmp_path / "cache")},
        "eval": {"transfer": [{"dataset": "stl10", "root": str(stl)}]}})
    (transfer,) = load_transfer_sets(config, channels=1)
    # Probed on train (no unlabelled images: they have no labels), scored on test.
    assert (len(transfer.train.images), len(transfer.test.images)) == (20, 10)
    assert transfer.train.images.shape[1:] == (1, 16, 16)
    assert sorted(transfer.train.labels["class"].tolist()) == sorted(list(range(10)) * 2)
    missing = tmp_path / "search.yaml"
    wrong_format = f"eval: {{transfer: [{{dataset: cifar10, root: {stl}}}]}}\n"
    missing.write_text(textwrap.dedent(SEARCH).replace("{METHOD}", "simclr").replace(
        "{DATA}", "{dataset: digits}") + wrong_format)
    with pytest.raises(ConfigError, match=r"eval\.transfer\.0\.root: .* holds no CIFAR-10 python "
                                          r"batches"):
        load_search(missing)


def test_unreadable_images_in_a_folder_are_named_and_counted_before_launch(
        tmp_path: Path) -> None:
    from PIL import Image

    root = tmp_path / "shapes"
    for name in ("circle", "square"):
        (root / name).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(root / name / f"{i}.png")
    (root / "circle" / "1.png").write_bytes(b"not a png")
    (root / "square" / "2.png").write_bytes(b"")
    message = search_error(tmp_path, f"{{dataset: folder, root: {root}}}")
    assert message.startswith(f"{tmp_path / 'search.yaml'}: data.root: cannot read image "
                              f"'{root / 'circle' / '1.png'}': ")
    assert f"'{root / 'square' / '2.png'}': empty file" in message  # both named
    assert message.endswith("(2 of 6 image files unreadable): set data.skip_unreadable: true "
                            "to leave them out")


def test_a_launch_lists_an_imagenet_root_once_and_nothing_is_kept_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """The launch's checks (data, split sizes, batch feasibility) all need the root's listing,
    which in a bucket is a request per thousand files: the CLI lists each half once. Outside a
    launch nothing is remembered: an image added since is seen."""
    from raycl.data.listed_once import listed_once
    from raycl.data.sources import imagenet
    from raycl.tune import main

    root = write_imagenet(tmp_path / "imagenet", WNIDS, per_class_train=10, per_class_val=2)
    listed: list[str] = []
    list_half = imagenet._list_half

    def counting(folder: Any, wnids: Any) -> Any:
        listed.append(Path(str(folder)).name)
        return list_half(folder, wnids)

    monkeypatch.setattr(imagenet, "_list_half", counting)
    assert main(["searches/quickstart.yaml", "--set", "data.dataset=imagenet",
                 "--set", f"data.root={root}", "--set", "data.resolution=8",
                 "--set", "train.batch_size=4", "--dry-run"]) == 0
    assert "imagenet" in capsys.readouterr().out
    assert sorted(listed) == ["train", "val"]

    cfg = data_config(tmp_path, "imagenet", root, resolution=8)
    with listed_once():
        before = split_sizes_for(cfg)["train"]
        extra = root / "train" / WNIDS[0] / "added.JPEG"
        shutil.copy(next((root / "train" / WNIDS[0]).iterdir()), extra)
        assert split_sizes_for(cfg)["train"] == before  # the scope's one listing
    assert split_sizes_for(cfg)["train"] == before + 1
