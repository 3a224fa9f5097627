"""Linear probes on a share of the training labels (eval.label_fractions) and the retrieval
metrics, as evaluate_features reports them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_config import BASE, error_of  # one-line ConfigError of a YAML in tmp_path

from raycl.config.metric_names import fraction_percent
from raycl.config.schema import CoreConfig
from raycl.data import DatasetSplits, ImageSet, stratified_subset
from raycl.eval import evaluate_linear_splits
from raycl.eval.label_fractions import label_fraction_subset
from raycl.eval.scoring import evaluate_features
from raycl.methods import SearchConfig


def per_class(labels: np.ndarray, subset: np.ndarray) -> list[int]:
    return np.bincount(labels[subset], minlength=labels.max() + 1).tolist()


@pytest.mark.parametrize(
    ("sizes", "fraction", "expected"),
    [
        ([40] * 5, 0.5, [20] * 5),
        ([40] * 5, 0.2, [8] * 5),
        ([60, 30, 10], 0.5, [30, 15, 5]),
        ([60, 30, 10], 0.2, [12, 6, 2]),
    ],
)
def test_subset_is_stratified_with_the_rounded_size(
    sizes: list[int], fraction: float, expected: list[int]
) -> None:
    labels = np.repeat(np.arange(len(sizes)), sizes)
    subset = label_fraction_subset(labels, fraction, seed=0)
    assert subset.size == round(fraction * labels.size)
    assert per_class(labels, subset) == expected
    assert np.all(np.diff(subset) > 0)  # sorted, distinct


def test_subset_is_seeded() -> None:
    labels = np.random.default_rng(1).integers(0, 7, size=300)
    first = label_fraction_subset(labels, 0.2, seed=3)
    assert np.array_equal(first, label_fraction_subset(labels, 0.2, seed=3))
    assert not np.array_equal(first, label_fraction_subset(labels, 0.2, seed=4))


def test_every_class_keeps_a_label_when_the_subset_has_room() -> None:
    labels = np.array([0] * 95 + [1, 2, 3, 4, 5])
    # Proportional rounding gives all 10 places to class 0; one per class comes first.
    subset = label_fraction_subset(labels, 0.1, seed=0)
    assert subset.size == 10
    assert per_class(labels, subset) == [5, 1, 1, 1, 1, 1]
    # Two places cannot cover six classes: plain proportional rounding.
    assert per_class(labels, label_fraction_subset(labels, 0.02, seed=0)) == [2, 0, 0, 0, 0, 0]
    # At least one row, however small the share.
    assert label_fraction_subset(labels, 0.001, seed=0).size == 1


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5])
def test_subset_rejects_a_fraction_outside_the_unit_interval(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\]"):
        label_fraction_subset(np.zeros(10, dtype=np.int64), fraction, seed=0)


def blob_splits(num_train: int = 120, num_eval: int = 30) -> DatasetSplits:
    """Labels only (evaluate_features never looks at the images): attribute ``shape`` (3
    classes, the blob of :func:`blob_features`) and ``parity``, unrelated to the features."""

    def image_set(count: int) -> ImageSet:
        labels = {"shape": np.arange(count) % 3, "parity": np.arange(count) // 3 % 2}
        return ImageSet(np.zeros((count, 1, 2, 2), dtype=np.uint8), labels)

    train, val, test = image_set(num_train), image_set(num_eval), image_set(num_eval)
    return DatasetSplits(name="blobs", train=train, val=val, test=test,
                         attributes=["shape", "parity"], num_classes={"shape": 3, "parity": 2},
                         channels=1, resolution=2)


def blob_features(data: DatasetSplits, dim: int = 8) -> dict[str, np.ndarray]:
    """Features of every split: a Gaussian blob per ``shape`` class."""
    rng = np.random.default_rng(1)
    centres = rng.normal(scale=3.0, size=(3, dim))
    return {split: (centres[data.split(split).labels["shape"]]
                    + rng.normal(size=(len(data.split(split).images), dim))).astype(np.float32)
            for split in ("train", "val", "test")}


def config(**eval_section: object) -> CoreConfig:
    return SearchConfig(name="t", method="simclr", eval={"linear_max_iter": 50, **eval_section})


def test_evaluate_features_reports_each_share_and_retrieval() -> None:
    data = blob_splits()
    features = blob_features(data)
    metrics = evaluate_features(config(label_fractions=[0.5, 0.2]), data, features)
    for split in ("val", "test"):
        for probe in ("linear", "linear_50pct", "linear_20pct", "knn"):
            for name in ("shape", "parity", "mean"):
                assert 0.0 <= metrics[f"{split}/{probe}/{name}"] <= 1.0
        for name in ("rank1", "rank5", "map"):
            assert 0.0 <= metrics[f"{split}/retrieval/{name}"] <= 1.0
    assert len(metrics) == 2 * (4 * 3 + 3)
    # The same subset at every evaluation: the same numbers.
    assert evaluate_features(config(label_fractions=[0.5, 0.2]), data, features) == metrics
    # By default only the full-label probe; MCL's stage prefix goes in front of every key.
    plain = evaluate_features(config(), data, {"train": features["train"],
                                               "val": features["val"]}, stage=0)
    assert sorted(key.split("/")[2] for key in plain) == sorted(
        ["linear"] * 3 + ["knn"] * 3 + ["retrieval"] * 3)
    assert all(key.startswith("stage0/val/") for key in plain)


def test_share_probe_is_fit_on_the_seeded_subset_of_the_capped_set() -> None:
    data = blob_splits()
    features = blob_features(data)
    cfg = config(label_fractions=[0.25], max_train_samples=60)
    metrics = evaluate_features(cfg, data, {"train": features["train"], "val": features["val"]})
    capped = stratified_subset(data.train.labels["shape"], 60, cfg.seed)
    keep = capped[label_fraction_subset(data.train.labels["shape"][capped], 0.25, cfg.seed)]
    assert keep.size == 15
    expected = evaluate_linear_splits(
        features["train"][keep], {name: labels[keep] for name, labels in data.train.labels.items()},
        {"val": (features["val"], data.val.labels)}, max_iter=50, seed=cfg.seed)
    assert {name: metrics[f"val/linear_25pct/{name}"] for name in ("shape", "parity", "mean")} \
        == expected["val"]


@pytest.mark.parametrize(
    ("fractions", "why"),
    [
        ("[0.5, 1.0]", "must be in (0, 1), got [1.0]"),
        ("[0, 0.2]", "must be in (0, 1), got [0.0]"),
        ("[-0.1]", "must be in (0, 1)"),
        ("[0.5, 0.5]", "must be distinct"),
        ("[0.5, ten]", "valid number"),
    ],
)
def test_label_fractions_are_validated(tmp_path: Path, fractions: str, why: str) -> None:
    message = error_of(tmp_path, BASE + f"eval: {{label_fractions: {fractions}}}\n")
    assert message.startswith(f"{tmp_path / 'search.yaml'}: eval.label_fractions")
    assert why in message


def test_label_fractions_default_and_valid_values() -> None:
    assert SearchConfig(name="t", method="simclr").eval.label_fractions == []
    assert config(label_fractions=[0.5, 0.2]).eval.label_fractions == [0.5, 0.2]
    assert fraction_percent(0.2) == "20"
    assert fraction_percent(0.125) == "12.5"
