"""Datasets: Trifeature generator, MNIST+Fashion pairs, digits, image folders, split, cache."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from raycl.config.training import DataConfig
from raycl.data import (
    DATASETS,
    class_counts,
    load_dataset,
    load_image_set,
    split_sizes,
    split_sizes_for,
    stratified_split,
    stratified_subset,
)
from raycl.data.sources import trifeature
from raycl.data.sources.packaged import (
    FASHION_MNIST_DIR,
    balanced_subset,
    load_digits_set,
    load_fashion_mnist,
    load_mnist,
    make_mnist_fashion,
)
from raycl.data.sources.trifeature import (
    COLORS,
    SHAPE_NAMES,
    TEXTURES,
    generate_trifeature,
    render_object,
)

FASHION_PRESENT = (FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").exists()
needs_fashion = pytest.mark.skipif(
    not FASHION_PRESENT, reason="Debian package dataset-fashion-mnist not installed"
)


def data_cfg(tmp_path: Path, **overrides: Any) -> DataConfig:
    """The data settings with small defaults (the schema's for every other key)."""
    fields: dict[str, Any] = dict(dataset="trifeature", resolution=16, samples_per_combination=1,
                                  val_fraction=0.1, test_fraction=0.2, cache_dir=str(tmp_path))
    fields.update(overrides)
    return DataConfig(**fields)


def unvalidated_cfg(tmp_path: Path, **overrides: Any) -> DataConfig:
    """:func:`data_cfg` built as a transfer set's settings are, without the schema's validation:
    what the data layer itself refuses or accepts."""
    return DataConfig.model_construct(**{**data_cfg(tmp_path).model_dump(), **overrides})


@pytest.fixture(scope="module")
def small_trifeature():
    return generate_trifeature(samples_per_combination=1, resolution=16, seed=0)


# --- Trifeature ---------------------------------------------------------------------------


def test_trifeature_is_deterministic_in_the_seed(small_trifeature) -> None:
    again = generate_trifeature(1, 16, seed=0)
    other = generate_trifeature(1, 16, seed=1)
    assert again.images.tobytes() == small_trifeature.images.tobytes()
    for name in ("shape", "texture", "color"):
        np.testing.assert_array_equal(again.labels[name], small_trifeature.labels[name])
    assert not np.array_equal(other.images, small_trifeature.images)


def test_trifeature_shapes_dtypes_and_each_combination_exactly_n_times() -> None:
    data = generate_trifeature(samples_per_combination=2, resolution=8, seed=5)
    assert data.images.shape == (2000, 3, 8, 8) and data.images.dtype == np.uint8
    assert set(data.labels) == {"shape", "texture", "color"}
    triples = np.stack([data.labels[k] for k in ("shape", "texture", "color")], axis=1)
    assert triples.dtype == np.int64
    combos, counts = np.unique(triples, axis=0, return_counts=True)
    assert len(combos) == 1000 and np.all(counts == 2)
    # Black background: at 8 px (wide antialiased edges) still a third of every image.
    assert (data.images.max(axis=1) == 0).mean(axis=(1, 2)).min() > 0.33


def test_solid_objects_have_their_table_colour(small_trifeature) -> None:
    colors = np.array(list(COLORS.values()), dtype=np.float64)
    solid = np.flatnonzero(small_trifeature.labels["texture"] == TEXTURES.index("solid"))
    assert len(solid) == 100
    for index in solid:
        pixels = small_trifeature.images[index].reshape(3, -1).T.astype(np.float64)
        brightness = pixels.sum(axis=1)
        interior = pixels[brightness >= 0.95 * brightness.max()]  # skip antialiased edges
        mean = interior.mean(axis=0)
        np.testing.assert_allclose(mean, colors[small_trifeature.labels["color"][index]],
                                   atol=4.0)


def test_colour_table_is_well_separated() -> None:
    colors = np.array(list(COLORS.values()), dtype=np.float64)
    distances = np.linalg.norm(colors[:, None] - colors[None], axis=-1)
    assert distances[~np.eye(10, dtype=bool)].min() > 60


def test_each_shape_has_its_own_mask_and_a_sensible_size() -> None:
    white = list(COLORS).index("white")
    masks = []
    for shape in range(len(SHAPE_NAMES)):
        image = render_object(shape, 0, white, angle=0.3, center=(0.5, 0.5), resolution=32)
        masks.append(image.max(axis=0) > 127)
    for mask in masks:
        assert 0.08 < mask.mean() < 0.45, "object should fill a good part of the image"
    for first, second in itertools.combinations(range(len(masks)), 2):
        union = (masks[first] | masks[second]).sum()
        overlap = (masks[first] & masks[second]).sum() / union
        assert overlap < 0.9, f"{SHAPE_NAMES[first]} and {SHAPE_NAMES[second]} look alike"


def test_rotation_and_textures_change_the_image() -> None:
    square = SHAPE_NAMES.index("square")
    upright = render_object(square, 0, 0, angle=0.0, center=(0.5, 0.5), resolution=32)
    turned = render_object(square, 0, 0, angle=np.pi / 4, center=(0.5, 0.5), resolution=32)
    assert not np.array_equal(upright > 0, turned > 0)
    noise = (np.arange(256).reshape(16, 16) % 3 == 0).astype(np.float64)
    textured = [render_object(square, texture, 0, 0.2, (0.5, 0.5), 32, noise_table=noise)
                for texture in range(len(TEXTURES))]
    for first, second in itertools.combinations(range(len(textured)), 2):
        difference = np.abs(textured[first].astype(int) - textured[second].astype(int)).mean()
        assert difference > 1.0, f"{TEXTURES[first]} and {TEXTURES[second]} look alike"


# --- split and cache ----------------------------------------------------------------------


def test_stratified_split_is_disjoint_complete_and_proportional() -> None:
    labels = np.repeat(np.arange(4), [10, 20, 30, 40])
    train, val, test = stratified_split(labels, 0.2, seed=0, val_fraction=0.1)
    for a, b in ((train, val), (train, test), (val, test)):
        assert np.intersect1d(a, b).size == 0
    np.testing.assert_array_equal(np.sort(np.concatenate([train, val, test])), np.arange(100))
    np.testing.assert_array_equal(np.bincount(labels[test]), [2, 4, 6, 8])
    np.testing.assert_array_equal(np.bincount(labels[val]), [1, 2, 3, 4])
    again = stratified_split(labels, 0.2, seed=0, val_fraction=0.1)
    for first, second in zip(again, (train, val, test), strict=True):
        np.testing.assert_array_equal(first, second)
    assert not np.array_equal(stratified_split(labels, 0.2, seed=1, val_fraction=0.1)[1], val)
    # The test split does not move when a validation split is carved out of the rest.
    np.testing.assert_array_equal(stratified_split(labels, 0.2, seed=0)[2], test)
    # A singleton class stays in train.
    train, val, test = stratified_split(np.array([0, 1, 1, 1, 1]), 0.5, seed=0, val_fraction=0.25)
    assert 0 in train and len(test) == 2 and len(val) == 1
    with pytest.raises(ValueError, match="val_fraction"):
        stratified_split(labels, 0.5, seed=0, val_fraction=0.5)


@pytest.mark.parametrize("counts", [[10, 20, 30, 40], [1, 1, 7], [500] * 10, [3, 5, 9, 11, 13]])
@pytest.mark.parametrize(("val_fraction", "test_fraction"), [(0.1, 0.2), (0.25, 0.25), (0.05, 0.5)])
def test_split_sizes_match_the_split(counts, val_fraction, test_fraction) -> None:
    """The sizes a config check computes without data are the sizes the split produces."""
    labels = np.repeat(np.arange(len(counts)), counts)
    train, val, test = stratified_split(labels, test_fraction, seed=3, val_fraction=val_fraction)
    assert split_sizes(counts, val_fraction, test_fraction) == {
        "train": len(train), "val": len(val), "test": len(test)}


def test_split_sizes_for_configs_match_loaded_datasets(tmp_path: Path) -> None:
    for cfg in (data_cfg(tmp_path, resolution=8),
                data_cfg(tmp_path, dataset="digits", resolution=8, val_fraction=0.15)):
        splits = load_dataset(cfg, seed=0)
        assert split_sizes_for(cfg) == {name: len(splits.split(name).images)
                                        for name in ("train", "val", "test")}
    # mnist_fashion's digit counts are those balanced_subset draws (no Fashion-MNIST needed).
    rng = np.random.default_rng(0)
    digits = balanced_subset(np.repeat(np.arange(10), 500), 1234, rng)
    expected = np.bincount(np.repeat(np.arange(10), 500)[digits])
    cfg = data_cfg(tmp_path, dataset="mnist_fashion", num_samples=1234)
    assert sorted(class_counts(cfg)) == sorted(expected.tolist())


def test_stratified_subset_keeps_class_proportions() -> None:
    # Sorted by class, as a folder dataset is: the first rows would all be class 0.
    labels = np.repeat(np.arange(3), [600, 300, 100])
    keep = stratified_subset(labels, 100, seed=0)
    assert len(keep) == 100 and len(np.unique(keep)) == 100
    np.testing.assert_array_equal(np.bincount(labels[keep]), [60, 30, 10])
    np.testing.assert_array_equal(keep, stratified_subset(labels, 100, seed=0))
    assert not np.array_equal(keep, stratified_subset(labels, 100, seed=1))
    # Largest remainders: 7 of (5, 3, 2) -> exact shares 3.5, 2.1, 1.4 -> 4, 2, 1.
    small = np.repeat(np.arange(3), [5, 3, 2])
    np.testing.assert_array_equal(np.bincount(small[stratified_subset(small, 7, 0)]), [4, 2, 1])
    np.testing.assert_array_equal(stratified_subset(labels, 5000, seed=0), np.arange(1000))


def test_load_dataset_trifeature_splits(tmp_path: Path) -> None:
    splits = load_dataset(data_cfg(tmp_path), seed=0)
    assert splits.name == "trifeature" and splits.attributes == ["shape", "texture", "color"]
    assert splits.num_classes == {"shape": 10, "texture": 10, "color": 10}
    assert (splits.channels, splits.resolution) == (3, 16)
    assert splits.train.images.shape == (700, 3, 16, 16)
    assert splits.val.images.shape == (100, 3, 16, 16)
    assert splits.test.images.shape == (200, 3, 16, 16)
    # Stratified on the first attribute: 20 test and 10 validation images of each shape.
    np.testing.assert_array_equal(np.bincount(splits.test.labels["shape"]), [20] * 10)
    np.testing.assert_array_equal(np.bincount(splits.val.labels["shape"]), [10] * 10)
    # No image is in two splits (each rendered image is unique).
    rows = [{row.tobytes() for row in splits.split(name).images} for name in ("train", "val",
                                                                             "test")]
    assert not (rows[0] & rows[1] or rows[0] & rows[2] or rows[1] & rows[2])


def test_cache_is_written_once_and_then_hit(tmp_path: Path, monkeypatch) -> None:
    calls = []
    real = trifeature.generate_trifeature

    def counting(*args: Any, **kwargs: Any):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(trifeature, "generate_trifeature", counting)
    cfg = data_cfg(tmp_path, resolution=8)
    first = load_dataset(cfg, seed=0)
    files = list(tmp_path.glob("*/images.npy"))
    assert len(calls) == 1 and len(files) == 1
    written = files[0].stat().st_mtime_ns
    second = load_dataset(cfg, seed=0)
    assert len(calls) == 1, "second load must come from the cache"
    assert files[0].stat().st_mtime_ns == written
    np.testing.assert_array_equal(first.train.images, second.train.images)
    np.testing.assert_array_equal(first.test.labels["color"], second.test.labels["color"])
    # A parameter that changes the content gets its own file.
    load_dataset(cfg, seed=1)
    load_dataset(data_cfg(tmp_path, resolution=8, samples_per_combination=2), seed=0)
    assert len(calls) == 3 and len(list(tmp_path.glob("*/images.npy"))) == 3
    # test_fraction does not change the cached arrays.
    load_dataset(data_cfg(tmp_path, resolution=8, test_fraction=0.5), seed=0)
    assert len(calls) == 3
    assert not list(tmp_path.glob("*.tmp-*")), "no temporary directories left behind"


def test_corrupt_cache_file_is_regenerated(tmp_path: Path) -> None:
    cfg = data_cfg(tmp_path, resolution=8)
    expected = np.asarray(load_dataset(cfg, seed=0).train.images)
    (images_file,) = tmp_path.glob("*/images.npy")
    images_file.write_bytes(b"not an array")
    again = load_dataset(cfg, seed=0)
    np.testing.assert_array_equal(again.train.images, expected)
    (meta_file,) = tmp_path.glob("*/meta.npz")
    meta_file.unlink()
    np.testing.assert_array_equal(load_dataset(cfg, seed=0).train.images, expected)


def test_cache_dir_none_uses_raycl_cache_env(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RAYCL_CACHE", str(tmp_path / "env-cache"))
    load_dataset(data_cfg(tmp_path, dataset="digits", resolution=8, cache_dir=None), seed=0)
    assert len(list((tmp_path / "env-cache").glob("digits-*/images.npy"))) == 1


def test_unknown_dataset_and_folder_without_root_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"(?s)unknown dataset 'cifar'.*trifeature"):
        load_dataset(unvalidated_cfg(tmp_path, dataset="cifar"), seed=0)
    with pytest.raises(ValueError, match=r"needs data\.root"):
        load_dataset(unvalidated_cfg(tmp_path, dataset="folder"), seed=0)
    assert set(DATASETS) == {"trifeature", "mnist_fashion", "fashion_mnist", "digits", "folder",
                             "pairs", "cifar10", "cifar100", "stl10", "imagenet", "imagenet100",
                             "webdataset", "parquet"}


# --- MNIST + Fashion-MNIST, digits --------------------------------------------------------


def _nearest_centroid_accuracy(images: np.ndarray, labels: np.ndarray) -> float:
    """Fit class means on the first half, classify the second half by the nearest mean."""
    flat = images.reshape(len(images), -1).astype(np.float64)
    half = len(flat) // 2
    means = np.stack([flat[:half][labels[:half] == c].mean(axis=0) for c in range(10)])
    distances = ((flat[half:, None] - means[None]) ** 2).sum(axis=-1)
    return float((distances.argmin(axis=1) == labels[half:]).mean())


@needs_fashion
def test_mnist_fashion_channels_carry_digit_and_garment() -> None:
    data = make_mnist_fashion(num_samples=2000, resolution=28, seed=0)
    assert data.images.shape == (2000, 2, 28, 28) and data.images.dtype == np.uint8
    np.testing.assert_array_equal(np.bincount(data.labels["digit"]), [200] * 10)
    digit, garment = data.labels["digit"], data.labels["garment"]
    assert _nearest_centroid_accuracy(data.images[:, 0], digit) > 0.6
    assert _nearest_centroid_accuracy(data.images[:, 1], garment) > 0.5
    assert _nearest_centroid_accuracy(data.images[:, 0], garment) < 0.3
    assert _nearest_centroid_accuracy(data.images[:, 1], digit) < 0.3
    # At 28 px every channel is an untouched source image carrying its own label.
    mnist_images, mnist_labels = load_mnist()
    mnist = {(image.tobytes(), int(label))
             for image, label in zip(mnist_images, mnist_labels, strict=True)}
    fashion_images, fashion_labels = load_fashion_mnist()
    fashion = {(image.tobytes(), int(label))
               for image, label in zip(fashion_images, fashion_labels, strict=True)}
    for index in range(0, 2000, 97):
        assert (data.images[index, 0].tobytes(), int(digit[index])) in mnist
        assert (data.images[index, 1].tobytes(), int(garment[index])) in fashion


@needs_fashion
def test_mnist_fashion_resizes_and_validates(tmp_path: Path) -> None:
    splits = load_dataset(data_cfg(tmp_path, dataset="mnist_fashion", num_samples=500,
                                   resolution=32), seed=3)
    assert splits.attributes == ["digit", "garment"] and splits.channels == 2
    # 50 per digit: 10 test, 5 validation, 35 train.
    assert splits.train.images.shape == (350, 2, 32, 32)
    assert len(splits.val.images) == 50 and len(splits.test.images) == 100
    with pytest.raises(ValueError, match="num_samples"):
        make_mnist_fashion(num_samples=6000, resolution=28, seed=0)


def test_missing_fashion_mnist_names_the_debian_package(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        load_fashion_mnist(tmp_path)
    monkeypatch.setattr("raycl.data.sources.packaged.FASHION_MNIST_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        make_mnist_fashion(num_samples=100, resolution=28, seed=0)


def test_balanced_subset_counts_differ_by_at_most_one() -> None:
    labels = np.repeat(np.arange(3), [50, 30, 5])
    chosen = balanced_subset(labels, 31, np.random.default_rng(0))
    assert len(np.unique(chosen)) == 31
    # 5 of the small class, the other 26 split 13/13.
    np.testing.assert_array_equal(np.bincount(labels[chosen]), [13, 13, 5])


def test_digits_set(tmp_path: Path) -> None:
    data = load_digits_set(resolution=16, seed=0)
    assert data.images.shape == (1797, 1, 16, 16) and data.images.dtype == np.uint8
    assert data.images.max() == 255
    assert np.bincount(data.labels["digit"]).min() >= 174
    assert _nearest_centroid_accuracy(data.images, data.labels["digit"]) > 0.8
    native = load_digits_set(resolution=8, seed=0)
    from sklearn.datasets import load_digits

    source = load_digits()
    first = native.images[0, 0].astype(np.float64) * 16 / 255
    match = np.flatnonzero(np.abs(source.images - first).max(axis=(1, 2)) < 0.5)
    assert native.labels["digit"][0] in source.target[match]
    splits = load_dataset(data_cfg(tmp_path, dataset="digits", resolution=8), seed=0)
    assert splits.channels == 1 and splits.num_classes == {"digit": 10}


# --- image folders ------------------------------------------------------------------------


def _write_image(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array.astype(np.uint8)).save(path)


def _make_folder(root: Path) -> None:
    # A wide cat image: green side bands that the centre crop must cut away.
    wide = np.zeros((10, 20, 3))
    wide[:, :, 1] = 255
    wide[:, 5:15] = (255, 0, 0)
    _write_image(root / "cat" / "a.png", wide)
    _write_image(root / "cat" / "b.png", np.full((12, 12, 3), (255, 0, 0)))
    _write_image(root / "cat" / "c.jpg", np.full((9, 9, 3), (255, 0, 0)))
    _write_image(root / "dog" / "a.png", np.full((16, 8, 3), (0, 0, 255)))
    (root / "dog" / "notes.txt").write_text("not an image")
    (root / "empty").mkdir()


def test_image_folder_loader(tmp_path: Path) -> None:
    _make_folder(tmp_path / "images")
    data = load_image_set(data_cfg(tmp_path / "cache", dataset="folder",
                                   root=str(tmp_path / "images"), resolution=8), seed=0)
    assert data.images.shape == (4, 3, 8, 8) and data.images.dtype == np.uint8
    np.testing.assert_array_equal(data.labels["class"], [0, 0, 0, 1])
    means = data.images.reshape(4, 3, -1).mean(axis=2)
    np.testing.assert_allclose(means[:3], [[255, 0, 0]] * 3, atol=6)  # red cats, bands cropped
    np.testing.assert_allclose(means[3], [0, 0, 255], atol=6)


def test_folder_dataset_cache_follows_the_files(tmp_path: Path) -> None:
    root = tmp_path / "images"
    _make_folder(root)
    cfg = data_cfg(tmp_path / "cache", dataset="folder", root=str(root), resolution=8,
                   test_fraction=0.5)
    splits = load_dataset(cfg, seed=0)
    assert splits.attributes == ["class"] and splits.num_classes == {"class": 2}
    assert sum(len(splits.split(n).images) for n in ("train", "val", "test")) == 4
    _write_image(root / "dog" / "b.png", np.full((8, 8, 3), (0, 0, 255)))
    splits = load_dataset(cfg, seed=0)
    assert sum(len(splits.split(n).images) for n in ("train", "val", "test")) == 5
    assert split_sizes_for(cfg)["train"] == len(splits.train.images)


def test_image_folder_errors_name_the_path(tmp_path: Path) -> None:
    def load(root: Path) -> Any:
        cfg = data_cfg(tmp_path / "cache", dataset="folder", root=str(root), resolution=8)
        return load_image_set(cfg, seed=0)

    with pytest.raises(FileNotFoundError, match="nowhere"):
        load(tmp_path / "nowhere")
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"no images in .*empty"):
        load(tmp_path / "empty")
    _write_image(tmp_path / "broken" / "cls" / "a.png", np.zeros((4, 4, 3)))
    (tmp_path / "broken" / "cls" / "b.png").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"cannot read image .*b\.png.*\(1 of 2 image files "
                                         r"unreadable\)"):
        load(tmp_path / "broken")


# --- image folders in the train/test layout (CUB-200, Stanford Cars, FGVC-Aircraft) ----------

# Class name -> colour; every image of a class has it, so a label can be checked by its pixels.
_COLOURS = {"albatross": (255, 0, 0), "bunting": (0, 255, 0), "cardinal": (0, 0, 255)}


def _make_train_test_folder(root: Path, train: dict[str, int], test: dict[str, int]) -> None:
    """root/train/<class>/<i>.png and root/test/<class>/<i>.png, 8x8 in the class colour."""
    for offset, (half, counts) in enumerate((("train", train), ("test", test))):
        for name, count in counts.items():
            for i in range(count):
                # A grey corner, its level unique per half and image, makes every image distinct.
                array = np.full((8, 8, 3), _COLOURS[name])
                array[:2, :2] = 20 * i + 10 * offset
                _write_image(root / half / name / f"{i:02d}.png", array)


def _class_of_pixels(images: np.ndarray) -> list[int]:
    """Class index (sorted names) of each image, read from its centre pixel's colour."""
    names = sorted(_COLOURS)
    by_colour = {_COLOURS[name]: index for index, name in enumerate(names)}
    return [by_colour[tuple(int(v) for v in image[:, 4, 4])] for image in images]


def test_train_test_folder_keeps_the_shipped_test_split(tmp_path: Path) -> None:
    from raycl.data.decode import decode_square
    from raycl.data.sources.folders import list_image_files

    root = tmp_path / "cub"
    # cardinal has no test images: allowed (its index still follows the sorted union).
    _make_train_test_folder(root, train={"albatross": 4, "bunting": 8, "cardinal": 4},
                            test={"albatross": 2, "bunting": 3})
    cfg = data_cfg(tmp_path / "cache", dataset="folder", root=str(root), resolution=8,
                   val_fraction=0.25, test_fraction=0.5, layout="auto")
    splits = load_dataset(cfg, seed=0)
    # Test is exactly test/, image for image and in order; test_fraction plays no part.
    test_files = list_image_files(root / "test")
    expected = np.stack([decode_square(path, 8) for path, _ in test_files])
    np.testing.assert_array_equal(splits.test.images, expected)
    np.testing.assert_array_equal(splits.test.labels["class"], [0, 0, 1, 1, 1])
    # Validation is a stratified 25 % of train/ (1, 2, 1), the rest is train.
    np.testing.assert_array_equal(np.bincount(splits.val.labels["class"]), [1, 2, 1])
    np.testing.assert_array_equal(np.bincount(splits.train.labels["class"]), [3, 6, 3])
    # One class index means one class in every split (the pixels carry the truth).
    for name in ("train", "val", "test"):
        part = splits.split(name)
        assert _class_of_pixels(part.images) == part.labels["class"].tolist()
    # No test image leaks into train or validation.
    test_rows = {image.tobytes() for image in splits.test.images}
    assert not test_rows & {image.tobytes() for image in splits.train.images}
    assert not test_rows & {image.tobytes() for image in splits.val.images}
    assert splits.num_classes == {"class": 3} and splits.channels == 3
    # The sizes a config check computes without reading images are the loaded ones.
    assert split_sizes_for(cfg) == {name: len(splits.split(name).images)
                                    for name in ("train", "val", "test")}
    assert class_counts(cfg) == [6, 11, 4]
    # The validation share follows the seed; the test split does not.
    other = load_dataset(cfg, seed=1)
    np.testing.assert_array_equal(other.test.images, splits.test.images)
    assert {i.tobytes() for i in other.val.images} != {i.tobytes() for i in splits.val.images}


def test_train_test_layout_is_detected_or_forced(tmp_path: Path) -> None:
    from raycl.data.sources.folders import resolve_layout

    split_root = tmp_path / "split"
    _make_train_test_folder(split_root, {"albatross": 2}, {"albatross": 1})
    flat_root = tmp_path / "flat"
    _make_folder(flat_root)
    # A flat dataset whose classes are called train and test holds images in them directly.
    vehicles = tmp_path / "vehicles"
    for name in ("train", "test", "bus"):
        _write_image(vehicles / name / "a.png", np.zeros((8, 8, 3)))
    assert resolve_layout(split_root) == "train_test"
    assert resolve_layout(flat_root) == "flat"
    assert resolve_layout(vehicles) == "flat"
    assert resolve_layout(split_root, "flat") == "flat"
    assert resolve_layout(split_root, "train_test") == "train_test"
    flat = load_dataset(data_cfg(tmp_path / "cache", dataset="folder", root=str(vehicles),
                                 resolution=8, test_fraction=0.3), seed=0)
    assert flat.num_classes == {"class": 3}


def test_train_test_folder_errors_name_the_folder(tmp_path: Path) -> None:
    from raycl.data.sources.folders import list_folder

    only_train = tmp_path / "only_train"
    _make_train_test_folder(only_train, {"albatross": 2}, {})
    with pytest.raises(FileNotFoundError, match=r"only_train/test/ does not exist"):
        list_folder(only_train, "train_test")
    with pytest.raises(ValueError, match=r"only_train has train/<class>/ but no "
                                         r"test/<class>/.*data\.layout: flat"):
        list_folder(only_train, "auto")
    test_only_class = tmp_path / "test_only"
    _make_train_test_folder(test_only_class, {"albatross": 2}, {"albatross": 1, "bunting": 1})
    with pytest.raises(ValueError, match=r"'bunting' of .*test_only/test have no images in "
                                         r".*test_only/train: a probe"):
        list_folder(test_only_class)
    with_val = tmp_path / "with_val"
    _make_train_test_folder(with_val, {"albatross": 2}, {"albatross": 1})
    _write_image(with_val / "val" / "albatross" / "a.png", np.zeros((8, 8, 3)))
    with pytest.raises(ValueError, match=r"with_val/val/ is not read"):
        list_folder(with_val)
    empty_test = tmp_path / "empty_test"
    _make_train_test_folder(empty_test, {"albatross": 2}, {})
    (empty_test / "test").mkdir()
    with pytest.raises(ValueError, match=r"no images in .*empty_test/test"):
        list_folder(empty_test, "train_test")
    with pytest.raises(ValueError, match="unknown folder layout"):
        list_folder(with_val, "nested")


def test_train_test_cache_fingerprints_both_halves(tmp_path: Path, monkeypatch) -> None:
    from raycl.data.sources import folders

    root = tmp_path / "cub"
    _make_train_test_folder(root, {"albatross": 3, "bunting": 3}, {"albatross": 1, "bunting": 1})
    cfg = data_cfg(tmp_path / "cache", dataset="folder", root=str(root), resolution=8,
                   val_fraction=0.3)
    first = load_dataset(cfg, seed=0)
    real = folders.image_folder_files
    calls = []
    monkeypatch.setattr(folders, "image_folder_files",
                        lambda *args, **kwargs: calls.append(args) or real(*args, **kwargs))
    again = load_dataset(cfg, seed=0)
    assert not calls, "an unchanged folder comes from the cache, test/ still marked"
    np.testing.assert_array_equal(again.test.images, first.test.images)
    np.testing.assert_array_equal(again.train.labels["class"], first.train.labels["class"])
    # A new test image, or an image moved from test/ to train/, is a new cache entry.
    _write_image(root / "test" / "bunting" / "new.png", np.full((8, 8, 3), (0, 255, 0)))
    assert len(load_dataset(cfg, seed=0).test.images) == 3 and len(calls) == 1
    (root / "test" / "bunting" / "new.png").rename(root / "train" / "bunting" / "new.png")
    moved = load_dataset(cfg, seed=0)
    assert len(moved.test.images) == 2 and len(calls) == 2
    assert len(moved.train.images) + len(moved.val.images) == 7


def test_transfer_style_config_without_layout_key_uses_the_test_folder(tmp_path: Path) -> None:
    """eval.transfer's settings: layout the default auto, val_fraction 0."""
    root = tmp_path / "cub"
    _make_train_test_folder(root, {"albatross": 3, "bunting": 2}, {"albatross": 1, "bunting": 2})
    cfg = unvalidated_cfg(tmp_path / "cache", dataset="folder", root=str(root), resolution=8,
                          val_fraction=0.0, test_fraction=0.3)
    splits = load_dataset(cfg, seed=0)
    assert (len(splits.train.images), len(splits.val.images), len(splits.test.images)) == (5, 0, 3)


def test_config_validation_knows_the_train_test_layout(tmp_path: Path) -> None:
    from test_config import error_of, write  # one-line ConfigError of a YAML in tmp_path

    from raycl.launch.load import load_search

    root = tmp_path / "cub"
    _make_train_test_folder(root, {"albatross": 8, "bunting": 8}, {"albatross": 2, "bunting": 2})
    text = f"""
    name: t
    data: {{dataset: folder, root: {root}, resolution: 8, val_fraction: 0.25}}
    train: {{epochs: 1, batch_size: BATCH}}
    tune: {{num_samples: 1}}
    """
    config = load_search(write(tmp_path, text.replace("BATCH", "12")))
    assert config.data.layout == "auto"
    # The training split is train/ less its validation share: 16 - 4 = 12 images.
    assert "exceeds the training split (12 samples)" in error_of(tmp_path,
                                                                 text.replace("BATCH", "13"))
    # Forced flat, the train/ and test/ folders hold no images of their own.
    assert ": data.root: no images in" in error_of(
        tmp_path, text.replace("BATCH", "12").replace("val_fraction", "layout: flat, val_fraction"))
    (root / "test" / "bunting").rename(tmp_path / "aside")
    (root / "test" / "albatross").rename(root / "test" / "cardinal")
    _write_image(root / "test" / "cardinal" / "extra.png", np.zeros((8, 8, 3)))
    assert error_of(tmp_path, text.replace("BATCH", "12")).endswith(
        f"search.yaml: data.root: class folder(s) 'cardinal' of {root}/test have no images in "
        f"{root}/train: a probe fit on train cannot predict them")
    for child in (root / "test").rglob("*.png"):
        child.unlink()
    for child in sorted((root / "test").iterdir()):
        child.rmdir()
    (root / "test").rmdir()
    forced = text.replace("BATCH", "12").replace("val_fraction", "layout: train_test, val_fraction")
    assert error_of(tmp_path, forced).endswith(
        f"search.yaml: data.root: layout train_test needs {root}/train/ and {root}/test/, but "
        f"{root}/test/ does not exist")
    assert "data.layout: flat" in error_of(tmp_path, text.replace("BATCH", "12"))


def test_every_registered_dataset_has_a_reader() -> None:
    """A dataset is a registry entry naming a reader: each resolves and has the three methods."""
    from raycl.data.registry import SOURCES, reader

    assert set(SOURCES) == set(DATASETS)
    for name in SOURCES:
        source = reader(name)
        assert all(callable(getattr(source, method, None))
                   for method in ("content_key", "read", "class_counts")), name
    with pytest.raises(ValueError, match=r"(?s)unknown dataset 'cifar'.*trifeature"):
        reader("cifar")
