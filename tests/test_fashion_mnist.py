"""``data.dataset: fashion_mnist``: plain Fashion-MNIST from the Debian package (issue 47,
finding 2), its own train/test files, one channel, 10 garment classes, ``data.num_samples``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from raycl.config.evaluation import TransferConfig
from raycl.config.training import DataConfig
from raycl.data import CHANNELS, DATASETS, load_dataset, split_sizes_for
from raycl.data.registry import reader
from raycl.data.sources.packaged import FASHION_MNIST_DIR, read_fashion_split

FASHION_PRESENT = all((FASHION_MNIST_DIR / f"{split}-{kind}.gz").exists()
                      for split in ("train", "t10k")
                      for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"))
needs_fashion = pytest.mark.skipif(
    not FASHION_PRESENT, reason="Debian package dataset-fashion-mnist not installed"
)


def fashion_cfg(tmp_path: Path, **overrides: Any) -> DataConfig:
    """fashion_mnist at its stored 28 px (pixels compare with the package's), cached in tmp."""
    fields: dict[str, Any] = dict(dataset="fashion_mnist", resolution=28, val_fraction=0.1,
                                  test_fraction=0.2, cache_dir=str(tmp_path))
    return DataConfig(**{**fields, **overrides})


def rows_of(split: str) -> dict[bytes, int]:
    """The package file ``split``'s images (bytes) -> label."""
    images, labels = read_fashion_split(split)
    return {image.tobytes(): int(label) for image, label in zip(images, labels, strict=True)}


def test_fashion_mnist_is_registered_by_name() -> None:
    assert "fashion_mnist" in DATASETS and CHANNELS["fashion_mnist"] == 1
    assert "mnist_fashion" in DATASETS and CHANNELS["mnist_fashion"] == 2
    # The whole package: 60 000 train (validation carved from it), 10 000 test; no file read.
    assert split_sizes_for(DataConfig(dataset="fashion_mnist")) == {
        "train": 54000, "val": 6000, "test": 10000}
    # test_fraction is unused: the test split is the package's t10k files.
    assert split_sizes_for(DataConfig(dataset="fashion_mnist", test_fraction=0.5)) == {
        "train": 54000, "val": 6000, "test": 10000}


@needs_fashion
def test_fashion_mnist_subset_loads_with_its_own_splits(tmp_path: Path) -> None:
    cfg = fashion_cfg(tmp_path, num_samples=700)
    splits = load_dataset(cfg, seed=0)
    assert splits.name == "fashion_mnist" and splits.channels == 1
    assert splits.attributes == ["garment"] and splits.num_classes == {"garment": 10}
    # 700 drawn 6:1: 600 from train (60 per class, 6 of each to validation), 100 from t10k.
    sizes = {name: len(splits.split(name).images) for name in ("train", "val", "test")}
    assert sizes == {"train": 540, "val": 60, "test": 100} == split_sizes_for(cfg)
    assert splits.train.images.shape == (540, 1, 28, 28)
    assert splits.train.images.dtype == np.uint8
    for name, per_class in (("train", 54), ("val", 6), ("test", 10)):
        counts = np.bincount(splits.split(name).labels["garment"], minlength=10)
        assert counts.tolist() == [per_class] * 10, name
    # Test rows are the package's test file's images with its labels; train and val its train's.
    test_rows, train_rows = rows_of("t10k"), rows_of("train")
    for name, rows in (("test", test_rows), ("train", train_rows), ("val", train_rows)):
        split = splits.split(name)
        for image, label in zip(np.asarray(split.images), split.labels["garment"], strict=True):
            assert rows.get(image[0].tobytes()) == int(label), name
    # Another seed draws other images; the same seed the same (from the cache).
    again = load_dataset(cfg, seed=0)
    np.testing.assert_array_equal(np.asarray(again.test.images), np.asarray(splits.test.images))
    other = load_dataset(cfg, seed=1)
    assert not np.array_equal(np.asarray(other.test.images), np.asarray(splits.test.images))


@needs_fashion
def test_fashion_mnist_whole_package_test_split_is_the_t10k_file(tmp_path: Path) -> None:
    splits = load_dataset(fashion_cfg(tmp_path), seed=0)
    assert len(splits.train.images) + len(splits.val.images) == 60000
    test_images, test_labels = read_fashion_split("t10k")
    # Row for row, in the file's order.
    np.testing.assert_array_equal(splits.test.labels["garment"], test_labels)
    np.testing.assert_array_equal(np.asarray(splits.test.images)[:, 0], test_images)
    # Resized on request, one channel kept.
    small = load_dataset(fashion_cfg(tmp_path, resolution=32, num_samples=70), seed=0)
    assert small.train.images.shape[1:] == (1, 32, 32)


def test_num_samples_is_bounded_per_dataset() -> None:
    assert DataConfig(dataset="fashion_mnist", num_samples=20000).num_samples == 20000
    with pytest.raises(ValidationError, match=r"num_samples\n.*at most 5000 pairs"):
        DataConfig(dataset="mnist_fashion", num_samples=6000)
    with pytest.raises(ValidationError, match="less than or equal to 70000"):
        DataConfig(dataset="fashion_mnist", num_samples=70001)
    assert TransferConfig(dataset="fashion_mnist", num_samples=7000).label == "fashion_mnist"
    with pytest.raises(ValidationError, match="at most 5000 pairs"):
        TransferConfig(dataset="mnist_fashion", num_samples=6000)


def test_missing_package_is_one_problem_naming_it(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("raycl.data.sources.packaged.FASHION_MNIST_DIR", tmp_path)
    source = reader("fashion_mnist")
    assert source.check(DataConfig(dataset="fashion_mnist")) == (
        "dataset", f"fashion_mnist needs Fashion-MNIST in {tmp_path} (Debian package "
                   f"dataset-fashion-mnist)")
    with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        source.read(DataConfig(dataset="fashion_mnist", num_samples=70), seed=0)
