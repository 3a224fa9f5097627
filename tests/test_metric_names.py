"""Metric names are one contract (raycl.config.metric_names): the names the worker reports are
exactly those of earlier sweeps (MLflow histories, stored sweeps), every one reads back into its
parts, and ``tune.metric`` accepts a validation name the worker reports and nothing else."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from pydantic import ValidationError
from test_label_fractions import blob_features, blob_splits, config

from raycl.config.metric_names import (
    DATA,
    DIAG,
    GROUPS,
    I2T,
    KNN,
    LINEAR,
    MCL,
    MEAN,
    MMVP,
    NN_RETRIEVAL,
    PERF,
    RETRIEVAL,
    SCORED_SPLITS,
    T2I,
    TEST,
    TRAIN,
    TRANSFER,
    VAL,
    ZEROSHOT,
    MetricName,
    MetricNameError,
    fraction_percent,
    maybe_metric,
    metric_name,
    parse_metric,
    split_stage,
    staged,
)
from raycl.config.sweep import TuneSection, reported_test_metric
from raycl.eval.scoring import evaluate_features

REPO = Path(__file__).resolve().parents[1]

# (parts, the name as every sweep so far has reported it), written out by hand.
TODAY: list[tuple[MetricName, str]] = [
    (MetricName(VAL, LINEAR, "shape"), "val/linear/shape"),
    (MetricName(VAL, LINEAR, MEAN), "val/linear/mean"),
    (MetricName(TEST, LINEAR, "colour", stage=2), "stage2/test/linear/colour"),
    (MetricName(VAL, LINEAR, MEAN, percent="50"), "val/linear_50pct/mean"),
    (MetricName(TEST, LINEAR, "shape", stage=0, percent="12.5"),
     "stage0/test/linear_12.5pct/shape"),
    (MetricName(VAL, KNN, "texture"), "val/knn/texture"),
    (MetricName(VAL, RETRIEVAL, "rank1"), "val/retrieval/rank1"),
    (MetricName(TEST, RETRIEVAL, "map", stage=1), "stage1/test/retrieval/map"),
    (MetricName(VAL, NN_RETRIEVAL, MEAN), "val/nn_retrieval/mean"),
    (MetricName(VAL, MMVP, MEAN), "val/mmvp/mean"),
    (MetricName(TEST, ZEROSHOT, "colour"), "test/zeroshot/colour"),
    (MetricName(VAL, I2T, "r1"), "val/i2t/r1"),
    (MetricName(TEST, T2I, "r10", stage=3), "stage3/test/t2i/r10"),
    (MetricName(TRANSFER, LINEAR, MEAN, transfer="digits"), "transfer/digits/linear/mean"),
    (MetricName(TRANSFER, LINEAR, "class", stage=1, transfer="cifar100"),
     "stage1/transfer/cifar100/linear/class"),
    (MetricName(TRAIN, None, "loss"), "train/loss"),
    (MetricName(TRAIN, None, "sampler_pure", stage=1), "stage1/train/sampler_pure"),
    (MetricName(PERF, None, "eval_seconds"), "perf/eval_seconds"),
    (MetricName(DATA, None, "skipped"), "data/skipped"),
    (MetricName(DIAG, None, "effective_rank"), "diag/effective_rank"),
    (MetricName(MCL, "ami", "stage0_stage1"), "mcl/ami/stage0_stage1"),
    (MetricName(MCL, None, "groups"), "mcl/groups"),
]


@pytest.mark.parametrize(("parts", "text"), TODAY, ids=[text for _, text in TODAY])
def test_every_family_writes_todays_name_and_reads_it_back(parts: MetricName, text: str) -> None:
    assert parts.format() == str(parts) == text
    assert metric_name(parts.split, parts.family, parts.name, stage=parts.stage,
                       percent=parts.percent, transfer=parts.transfer) == text
    assert parse_metric(text) == MetricName.parse(text) == maybe_metric(text) == parts
    assert split_stage(text) == (parts.stage, parts.replace(stage=None).format())


def test_stage_and_split_are_changed_on_the_parts() -> None:
    assert staged("train/loss", 2) == "stage2/train/loss"
    assert staged("data/skipped", 0) == "stage0/data/skipped"
    assert parse_metric("stage1/val/linear/mean").replace(split=TEST).format() == (
        "stage1/test/linear/mean")
    # A label share is written as its percentage, as every sweep so far wrote it.
    assert [fraction_percent(share) for share in (0.5, 0.2, 0.125, 0.01)] == [
        "50", "20", "12.5", "1"]


@pytest.mark.parametrize(("text", "why"), [
    ("eval/linear/mean", "'eval' is no split"),
    ("val/linear", "expected [stage<j>/]val/<family>/<name>"),
    ("val/linear/mean/extra", "expected [stage<j>/]val/<family>/<name>"),
    ("val/lineer/mean", "val is scored by linear, knn, retrieval"),
    ("val/linear_50xpct/mean", "not 'linear_50xpct'"),
    ("transfer/digits/zeroshot/mean", "transfer is scored by linear, knn, retrieval, "
                                      "linear_sgd, not 'zeroshot'"),
    ("transfer/linear/mean", "expected [stage<j>/]transfer/<set>/<family>/<name>"),
    ("stage01/val/linear/mean", "expected [stage<j>/]<split>/<family>/<name> or <group>/<name>"),
    ("objective", "expected [stage<j>/]<split>/<family>/<name> or <group>/<name>"),
    ("best/val/linear/mean", "expected"),
    ("val//mean", "not ''"),
    ("train/", "must be one non-empty path part"),
    ("val/linear/mean value", "no attribute or score"),
])
def test_invalid_names_are_rejected_saying_why(text: str, why: str) -> None:
    with pytest.raises(MetricNameError) as caught:
        parse_metric(text)
    assert str(caught.value).startswith(f"{text!r} is not a metric name")
    assert why in str(caught.value)
    assert maybe_metric(text) is None
    assert isinstance(caught.value, ValueError)  # pydantic reports it as the field's error


@pytest.mark.parametrize(("parts", "why"), [
    (dict(split=VAL, family=LINEAR, name="x", stage=-1), "stage must be an integer >= 0"),
    (dict(split=VAL, family=KNN, name="x", percent="50"), "label-fraction percent"),
    (dict(split=VAL, family=LINEAR, name="x", transfer="digits"), "transfer set's name"),
    (dict(split=TRANSFER, family=LINEAR, name="x"), "transfer set's name"),
    (dict(split="losses", family=None, name="x"), "'losses' is no split"),
])
def test_invalid_parts_are_rejected_saying_why(parts: dict, why: str) -> None:
    with pytest.raises(MetricNameError, match="not a metric name") as caught:
        MetricName(**parts)
    assert why in str(caught.value)


def test_tune_metric_accepts_the_validation_names_the_worker_reports() -> None:
    """What the worker's evaluation reports (one stage alone and the trial's representation, a
    label share) is what the schema lets an objective name: its val/ names all, test/ none."""
    data = blob_splits(num_train=60, num_eval=15)
    features = blob_features(data)
    reported = {**evaluate_features(config(label_fractions=[0.5]), data, features),
                **evaluate_features(config(), data, features, stage=1)}
    assert {"val/linear/shape", "val/linear_50pct/mean", "test/knn/parity",
            "val/retrieval/rank5", "stage1/val/linear/mean", "stage1/test/retrieval/map"} <= set(
        reported)
    for key in reported:
        name = parse_metric(key)  # every reported key is a name of the contract
        if name.split == VAL:
            assert TuneSection(metric=key).metric == key
            assert reported_test_metric(key) in reported  # its test counterpart is reported too
        else:
            with pytest.raises(ValidationError, match="is a test metric"):
                TuneSection(metric=key)


@pytest.mark.parametrize(("metric", "why"), [
    ("eval/linear/mean", "'eval/linear/mean' was renamed to 'val/linear/mean'"),
    ("stage1/eval/knn/shape", "renamed to 'stage1/val/knn/shape'"),
    ("test/linear/mean", "is a test metric"),
    ("stage2/test/linear/mean", "is a test metric"),
    ("transfer/digits/linear/mean", "is a transfer metric"),
    ("accuracy", "'accuracy' is not a metric name"),
    ("val/accuracy/mean", "val is scored by linear"),
])
def test_tune_metric_rules(metric: str, why: str) -> None:
    with pytest.raises(ValidationError) as caught:
        TuneSection(metric=metric)
    assert why in str(caught.value)


@pytest.mark.parametrize("metric", ["train/loss", "stage1/train/loss", "val/i2t/r1",
                                    "val/mmvp/mean", "val/linear_12.5pct/shape"])
def test_tune_metric_accepts_other_reported_names(metric: str) -> None:
    assert TuneSection(metric=metric).metric == metric


def test_reported_test_metric_is_the_test_name_of_a_validation_objective() -> None:
    assert reported_test_metric("val/linear/mean") == "test/linear/mean"
    assert reported_test_metric("stage2/val/knn/shape") == "stage2/test/knn/shape"
    assert reported_test_metric("val/linear_50pct/mean") == "test/linear_50pct/mean"
    assert reported_test_metric("train/loss") is None
    assert reported_test_metric("objective") is None


def test_every_name_the_code_writes_out_is_a_name_of_the_contract() -> None:
    """Names written as literals (``perf/peak_rss_mb``, ``train/lr``, the default objective)
    are names :func:`parse_metric` reads: a new one outside the contract fails here."""
    heads = "|".join((*SCORED_SPLITS, TRANSFER, *GROUPS))
    looks_like_a_name = re.compile(rf"(?:stage\d+/)?(?:{heads})/[^\s<>]+")
    written = [(f"{path.relative_to(REPO)}:{node.lineno}", node.value)
               for path in sorted((REPO / "raycl").rglob("*.py"))
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Constant) and isinstance(node.value, str)
               and looks_like_a_name.fullmatch(node.value)]
    assert len(written) >= 10, written  # the scan finds them (perf/, train/, data/, mcl/, ...)
    assert [(where, text) for where, text in written if maybe_metric(text) is None] == []
