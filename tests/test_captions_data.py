"""Image-text data: Trifeature's synthetic captions, CSV/TSV corpora (dataset pairs), their
random split, the cache, and the config keys that ask for them."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from raycl.config.schema import ConfigError
from raycl.config.training import DataConfig
from raycl.data import (
    CHANNELS,
    DATASETS,
    class_counts,
    load_dataset,
    load_image_set,
    random_split,
    split_sizes_for,
    unlabelled_split_sizes,
)
from raycl.data.decode import decode_square
from raycl.data.sources.captions import CAPTION_ORDER, describe
from raycl.launch.load import load_search

SPLIT_NAMES = ("train", "val", "test")


def data_cfg(tmp_path: Path, **overrides: Any) -> DataConfig:
    """The data settings with small defaults (the schema's for every other key)."""
    fields: dict[str, Any] = dict(dataset="trifeature", resolution=16, samples_per_combination=1,
                                  val_fraction=0.1, test_fraction=0.2,
                                  cache_dir=str(tmp_path / "cache"))
    fields.update(overrides)
    return DataConfig(**fields)


def _labels_of(part: Any, i: int) -> dict[str, int]:
    return {name: int(part.labels[name][i]) for name in CAPTION_ORDER}


# --- Trifeature's synthetic captions ------------------------------------------------------


def test_captions_follow_their_images_through_split_and_cache(tmp_path: Path) -> None:
    rates = {"color": 1.0, "shape": 0.5, "texture": 0.1}
    cfg = data_cfg(tmp_path, captions=rates)
    first = load_dataset(cfg, seed=0)
    again = load_dataset(cfg, seed=0)  # read from the cache; captions drawn again, equal
    assert len(list((tmp_path / "cache").glob("trifeature-*/images.npy"))) == 1
    seen: set[frozenset[str]] = set()
    for name in SPLIT_NAMES:
        part, cached = first.split(name), again.split(name)
        assert part.captions is not None and part.captions.dtype.kind == "U"
        assert len(part.captions) == len(part.images)
        np.testing.assert_array_equal(part.captions, cached.captions)
        for i, caption in enumerate(part.captions):
            # Each caption is the description of its own image's labels, colour always named.
            labels = _labels_of(part, i)
            named = next(frozenset(named) for named in _subsets_with_color()
                         if describe(labels, named) == caption)
            seen.add(named)
    # With rates 0.5 and 0.1 over 1000 images, several combinations of named attributes occur.
    assert {frozenset({"color"}), frozenset({"color", "shape"})} <= seen
    # The same config without captions shares the cached images and has no captions.
    plain = load_dataset(data_cfg(tmp_path), seed=0)
    assert plain.train.captions is None
    np.testing.assert_array_equal(plain.train.images, first.train.images)
    assert len(list((tmp_path / "cache").glob("trifeature-*/images.npy"))) == 1


def _subsets_with_color() -> list[tuple[str, ...]]:
    return [("color",), ("color", "shape"), ("color", "texture"), ("color", "texture", "shape")]


def test_rate_one_names_everything_and_colour_only_names_the_colour(tmp_path: Path) -> None:
    everything = load_image_set(
        data_cfg(tmp_path, captions=dict.fromkeys(CAPTION_ORDER, 1.0)), seed=0)
    colour = load_image_set(data_cfg(tmp_path, captions={"color": 1.0}), seed=0)
    assert everything.captions is not None and colour.captions is not None
    for i in range(0, len(everything.images), 37):
        labels = _labels_of(everything, i)
        assert everything.captions[i] == describe(labels, CAPTION_ORDER)
        assert colour.captions[i] == describe(labels, ("color",))
    assert all(caption.startswith("a") and caption.endswith(" object")
               and len(caption.split()) == 3 for caption in colour.captions)


def test_same_seed_same_captions_other_seed_other_draws(tmp_path: Path) -> None:
    rates = {"color": 0.5, "texture": 0.5, "shape": 0.5}
    one = load_image_set(data_cfg(tmp_path, captions=rates), seed=0)
    same = load_image_set(data_cfg(tmp_path / "elsewhere", captions=rates), seed=0)
    other = load_image_set(data_cfg(tmp_path, captions=rates), seed=1)
    np.testing.assert_array_equal(one.captions, same.captions)
    assert not np.array_equal(one.captions, other.captions)


def test_captions_on_another_dataset_are_refused_by_the_data_layer(tmp_path: Path) -> None:
    # Settings the schema never validated (it refuses this too): the data layer still does.
    cfg = DataConfig.model_construct(dataset="digits", resolution=8, captions={"color": 1.0},
                                     cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"data\.captions.*trifeature"):
        load_dataset(cfg, seed=0)


# --- CSV / TSV corpora ----------------------------------------------------------------------

# Image i is filled with colour _COLOURS[i], so its pixels tell which image landed where.
_COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255), (255, 0, 255)]
_CAPTIONS = ["a red square", "a green square", "a blue, square thing", "a yellow square",
             "a cyan square", 'a "magenta" square']


def _write_corpus(directory: Path) -> list[Path]:
    """Six 12x10 PNGs in directory/images/, one colour each."""
    paths = []
    for i, colour in enumerate(_COLOURS):
        path = directory / "images" / f"{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((10, 12, 3), colour, dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def _write_table(path: Path, header: tuple[str, str], rows: list[tuple[str, str]],
                 delimiter: str) -> Path:
    import csv

    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, delimiter=delimiter)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def _colour_index(images: np.ndarray) -> list[int]:
    return [_COLOURS.index(tuple(int(v) for v in image[:, 3, 3])) for image in images]


@pytest.mark.parametrize(("name", "header", "delimiter"), [
    ("corpus.csv", ("image", "caption"), ","),
    ("corpus.tsv", ("filepath", "title"), "\t"),
    ("corpus.txt", ("text", "Path"), "\t"),  # sniffed; column order and case do not matter
])
def test_csv_and_tsv_corpora_load_in_row_order(
    tmp_path: Path, name: str, header: tuple[str, str], delimiter: str
) -> None:
    paths = _write_corpus(tmp_path)
    order = [3, 0, 5, 1, 4, 2]
    rows = [(f"images/{i}.png", _CAPTIONS[i]) for i in order]
    if header[0] == "text":
        rows = [(caption, image) for image, caption in rows]
    table = _write_table(tmp_path / name, header, rows, delimiter)
    cfg = data_cfg(tmp_path, dataset="pairs", root=str(table), val_fraction=0.2,
                   test_fraction=0.2)
    full = load_image_set(cfg, seed=0)
    assert full.labels == {} and full.captions is not None
    assert full.images.shape == (6, 3, 16, 16) and full.images.dtype == np.uint8
    assert full.captions.tolist() == [_CAPTIONS[i] for i in order]
    assert _colour_index(full.images) == order
    np.testing.assert_array_equal(full.images[0], decode_square(paths[3], 16))

    splits = load_dataset(cfg, seed=0)
    assert splits.attributes == [] and splits.num_classes == {} and splits.channels == 3
    sizes = {part: len(splits.split(part).images) for part in SPLIT_NAMES}
    assert sizes == split_sizes_for(cfg) == {"train": 4, "val": 1, "test": 1}
    assert class_counts(cfg) == [6]
    # Every image lands in exactly one split, its caption with it.
    landed = []
    for part in SPLIT_NAMES:
        split = splits.split(part)
        assert split.labels == {}
        for index, caption in zip(_colour_index(split.images), split.captions, strict=True):
            assert caption == _CAPTIONS[index]
            landed.append(index)
    assert sorted(landed) == list(range(6))
    # The second load comes from the cache, captions included.
    assert len(list((tmp_path / "cache").glob("pairs-*/images.npy"))) == 1
    cached = load_dataset(cfg, seed=0)
    np.testing.assert_array_equal(cached.train.captions, splits.train.captions)
    np.testing.assert_array_equal(cached.test.images, splits.test.images)


def test_an_edited_corpus_is_read_again(tmp_path: Path) -> None:
    _write_corpus(tmp_path)
    table = _write_table(tmp_path / "c.csv", ("image", "caption"),
                         [(f"images/{i}.png", _CAPTIONS[i]) for i in range(6)], ",")
    cfg = data_cfg(tmp_path, dataset="pairs", root=str(table))
    assert load_image_set(cfg, seed=0).captions[0] == _CAPTIONS[0]
    _write_table(table, ("image", "caption"),
                 [(f"images/{i}.png", f"photo {i}") for i in range(6)], ",")
    assert load_image_set(cfg, seed=0).captions[0] == "photo 0"


def test_a_shared_image_is_decoded_once_and_repeated(tmp_path: Path) -> None:
    _write_corpus(tmp_path)
    rows = [("images/0.png", "first"), ("images/1.png", "other"), ("images/0.png", "second")]
    table = _write_table(tmp_path / "c.csv", ("image", "caption"), rows, ",")
    full = load_image_set(data_cfg(tmp_path, dataset="pairs", root=str(table)), seed=0)
    assert _colour_index(full.images) == [0, 1, 0]
    assert full.captions.tolist() == ["first", "other", "second"]


@pytest.mark.parametrize(("header", "rows", "why"), [
    (("file", "caption"), [("images/0.png", "x")], r"no image column: expected one of image"),
    (("image", "label"), [("images/0.png", "x")], r"no caption column"),
    (("image", "caption"), [("images/9.png", "x")], r"row 1 \(line 2\): image .*9\.png.* not "
                                                    r"found"),
    (("image", "caption"), [("images/0.png", "x"), ("images/0.png", "")], r"row 2.*empty"),
    (("image", "caption"), [], r"no image-caption rows"),
])
def test_bad_corpora_name_the_file(tmp_path: Path, header: tuple[str, str],
                                   rows: list[tuple[str, str]], why: str) -> None:
    _write_corpus(tmp_path)
    table = _write_table(tmp_path / "bad.csv", header, rows, ",")
    cfg = data_cfg(tmp_path, dataset="pairs", root=str(table))
    # split_sizes_for reads the table but opens no image, so it cannot see a missing one.
    checks = [load_dataset] + ([] if "found" in why else [lambda c, seed: split_sizes_for(c)])
    for call in checks:
        with pytest.raises(ValueError, match=why) as info:
            call(cfg, seed=0)
        assert str(info.value).startswith(str(table)) and "\n" not in str(info.value)


def test_empty_file_and_unreadable_image_are_one_line_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.csv: empty file"):
        load_dataset(data_cfg(tmp_path, dataset="pairs", root=str(empty)), seed=0)
    (tmp_path / "broken.png").write_bytes(b"not a png")
    table = _write_table(tmp_path / "c.csv", ("image", "caption"), [("broken.png", "x")], ",")
    # Decoded by the cache builder, which names the file and how many were unreadable.
    with pytest.raises(ValueError, match=r"cannot read image .*broken\.png.*\(1 of 1 image "
                                         r"files unreadable\)"):
        load_dataset(data_cfg(tmp_path, dataset="pairs", root=str(table)), seed=0)


def test_pairs_is_a_dataset_with_three_channels() -> None:
    assert "pairs" in DATASETS and CHANNELS["pairs"] == 3


# --- The random split of unlabelled sets ----------------------------------------------------


@pytest.mark.parametrize("count", [3, 6, 10, 101, 1000])
@pytest.mark.parametrize(("val_fraction", "test_fraction"), [(0.1, 0.2), (0.05, 0.05), (0.4, 0.5)])
def test_random_split_sizes_cover_every_image(count: int, val_fraction: float,
                                              test_fraction: float) -> None:
    train, val, test = random_split(count, val_fraction, test_fraction, seed=0)
    sizes = unlabelled_split_sizes(count, val_fraction, test_fraction)
    assert sizes == {"train": len(train), "val": len(val), "test": len(test)}
    assert min(sizes.values()) >= 1
    np.testing.assert_array_equal(np.sort(np.concatenate([train, val, test])), np.arange(count))
    if count >= 100:
        assert sizes["test"] == round(test_fraction * count)
        assert sizes["val"] == round(val_fraction * count)
    # Seeded; the test split does not depend on val_fraction.
    np.testing.assert_array_equal(test, random_split(count, 0.0, test_fraction, seed=0)[2])
    assert not np.array_equal(test, random_split(count, val_fraction, test_fraction, 1)[2]) \
        or count < 10


def test_random_split_refuses_too_few_images() -> None:
    with pytest.raises(ValueError, match="too few"):
        random_split(2, 0.1, 0.2, seed=0)
    assert unlabelled_split_sizes(3, 0.0, 0.2) == {"train": 2, "val": 0, "test": 1}


# --- Config ---------------------------------------------------------------------------------

BASE = """
name: t
method: simclr
data: {DATA}
train: {epochs: 2, batch_size: 4}
tune:
  num_samples: 1
"""


def _load(tmp_path: Path, data: str) -> Any:
    path = tmp_path / "search.yaml"
    path.write_text(textwrap.dedent(BASE).replace("{DATA}", data))
    return load_search(path)


def _error(tmp_path: Path, data: str) -> str:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, data)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(tmp_path / "search.yaml"))
    return message


def test_config_accepts_caption_rates_for_trifeature(tmp_path: Path) -> None:
    config = _load(tmp_path, "{dataset: trifeature, samples_per_combination: 1, "
                             "captions: {color: 1.0, shape: 0.5, texture: 0}}")
    assert config.data.captions == {"color": 1.0, "shape": 0.5, "texture": 0.0}


@pytest.mark.parametrize(("data", "key", "why"), [
    ("{dataset: digits, captions: {color: 1.0}}", "data", "data.captions is only for "
                                                          "data.dataset trifeature"),
    ("{captions: {colour: 1.0}}", "data.captions", "unknown caption attribute 'colour'"),
    ("{captions: {shape: 1.5}}", "data.captions", "must be in [0, 1], got 1.5"),
    ("{captions: {shape: -0.1}}", "data.captions", "must be in [0, 1]"),
    ("{dataset: pairs}", "data", "data.root is required when data.dataset is 'pairs'"),
])
def test_config_rejects_bad_caption_settings(tmp_path: Path, data: str, key: str,
                                             why: str) -> None:
    message = _error(tmp_path, data)
    assert message.startswith(f"{tmp_path / 'search.yaml'}: {key}: ")
    assert why in message


def test_config_loads_a_pairs_corpus(tmp_path: Path) -> None:
    _write_corpus(tmp_path)
    table = _write_table(tmp_path / "c.tsv", ("image", "caption"),
                         [(f"images/{i}.png", _CAPTIONS[i]) for i in range(6)], "\t")
    path = tmp_path / "search.yaml"
    path.write_text(textwrap.dedent(BASE).replace(
        "{DATA}", f"{{dataset: pairs, root: {table}, val_fraction: 0.2, test_fraction: 0.2}}"))
    # A caption file has no labels: only an image-text method, selected on caption retrieval.
    config = load_search(path, ["method=clip", "tune.metric=val/i2t/r1"])
    assert config.data.dataset == "pairs" and split_sizes_for(config.data)["train"] == 4
