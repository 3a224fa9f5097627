"""Scores of a representation on its features: linear probes, kNN and image retrieval per split,
and the transfer sets' probes. Pure functions of features and labels (no Ray, no collectives):
the worker calls them on rank 0 (:mod:`raycl.worker.evaluate`).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from raycl.config.metric_names import (
    KNN,
    LINEAR,
    RETRIEVAL,
    TRANSFER,
    fraction_percent,
    metric_name,
)
from raycl.config.schema import CoreConfig
from raycl.data import DatasetSplits, stratified_subset
from raycl.eval.image_retrieval import retrieval_scores
from raycl.eval.knn import evaluate_knn
from raycl.eval.label_fractions import label_fraction_subset
from raycl.eval.linear import evaluate_linear_splits
from raycl.eval.threads import reserved_threads, scoring_threads
from raycl.eval.transfer import TransferSet

# Split name -> (N_split, D) features (as :data:`raycl.worker.stage_integration.Features`).
Features = dict[str, np.ndarray]


def evaluate_features(
    config: CoreConfig,
    data: DatasetSplits,
    features: Features,
    stage: int | None = None,
    device: torch.device | None = None,
) -> dict[str, float]:
    """Linear probe and kNN per attribute, fit on ``features["train"]`` and scored on every other
    split in ``features``, as ``[stage<j>/]{split}/linear/<attribute>``, ``.../knn/...`` (the
    prefix for MCL's ``stage`` alone, :mod:`raycl.config.metric_names`); image
    retrieval within each scored split on the first attribute, ``.../retrieval/rank1``,
    ``rank5`` and ``map`` (each query against the rest of its split).

    ``eval.max_train_samples`` caps the probe's training set with a seeded subset stratified on
    the first attribute (the first rows of a folder dataset would be its first classes). Each of
    ``eval.label_fractions`` adds a probe fit on that share of the (capped) training labels,
    ``.../linear_<percent>pct/<attribute>`` (and ``/mean``), on a subset seeded by ``seed``, so
    every evaluation of a trial uses the same one.

    ``eval.knn_queries`` and ``eval.retrieval_queries`` cap the rows scored as kNN and retrieval
    queries (a seeded draw, :func:`raycl.eval.queries.sample_queries`), each still against the
    whole train split (kNN) or the whole rest of its split (retrieval). Everything runs with the
    threads of the worker's reservation, ``scaling.cpus_per_worker``
    (:func:`raycl.eval.threads.scoring_threads`): Ray leaves a worker's OpenMP and BLAS on one.
    """
    with scoring_threads(reserved_threads(config.scaling.cpus_per_worker)):
        return _score_features(config, data, features, stage, device)


def _score_features(
    config: CoreConfig,
    data: DatasetSplits,
    features: Features,
    stage: int | None,
    device: torch.device | None,
) -> dict[str, float]:
    """:func:`evaluate_features` inside its thread setting."""
    train_features = features["train"]
    train_labels = data.train.labels
    cap = config.eval.max_train_samples
    if cap is not None and cap < len(train_features):
        keep = stratified_subset(train_labels[data.attributes[0]], cap, config.data_seed)
        train_features = train_features[keep]
        train_labels = {name: labels[keep] for name, labels in train_labels.items()}
    eval_sets = {split: (values, data.split(split).labels)
                 for split, values in features.items() if split in ("val", "test")}
    backend = config.eval.linear_backend
    if backend == "auto":
        large = len(train_features) > 20_000 or (device is not None and device.type == "cuda")
        backend = "torch" if large else "sklearn"
    probe = partial(evaluate_linear_splits, eval_sets=eval_sets,
                    max_iter=config.eval.linear_max_iter, seed=config.seed, backend=backend,
                    device=device)
    # Label share (percent; None: all labels) -> split -> scores; the shares probe the same
    # splits.
    probes: dict[str | None, dict[str, dict[str, float]]] = {
        None: probe(train_features, train_labels)}
    for fraction in config.eval.label_fractions:
        keep = label_fraction_subset(train_labels[data.attributes[0]], fraction,
                                     config.data_seed)
        probes[fraction_percent(fraction)] = probe(
            train_features[keep], {name: labels[keep] for name, labels in train_labels.items()})
    metrics: dict[str, float] = {}
    for split, (values, labels) in eval_sets.items():
        for percent, scores in probes.items():
            metrics.update({metric_name(split, LINEAR, name, stage=stage, percent=percent): value
                            for name, value in scores[split].items()})
        knn = evaluate_knn(train_features, train_labels, values, labels, k=config.eval.knn_k,
                           max_queries=config.eval.knn_queries, seed=config.seed, device=device)
        metrics.update({metric_name(split, KNN, name, stage=stage): v
                        for name, v in knn.items()})
        retrieval = retrieval_scores(values, labels[data.attributes[0]],
                                     max_queries=config.eval.retrieval_queries, seed=config.seed,
                                     device=device)
        metrics.update({metric_name(split, RETRIEVAL, name, stage=stage): v
                        for name, v in retrieval.items()})
    return metrics


def evaluate_transfer(
    config: CoreConfig,
    transfer_sets: list[TransferSet],
    features: Features,
    stage: int | None = None,
    device: torch.device | None = None,
) -> dict[str, float]:
    """Linear probe per transfer set, fit on its probe-training share and scored on its held-out
    share: ``[stage<j>/]transfer/<name>/linear/<attribute>`` (and ``/mean``)."""
    metrics: dict[str, float] = {}
    with scoring_threads(reserved_threads(config.scaling.cpus_per_worker)):
        for transfer in transfer_sets:
            metrics.update(_transfer_scores(config, transfer, features, stage, device))
    return metrics


def _transfer_scores(
    config: CoreConfig,
    transfer: TransferSet,
    features: Features,
    stage: int | None,
    device: torch.device | None,
) -> dict[str, float]:
    """One transfer set's probe scores, as :func:`evaluate_transfer` names them."""
    scores = evaluate_linear_splits(
        features[transfer.train_key], transfer.train.labels,
        {"test": (features[transfer.test_key], transfer.test.labels)},
        max_iter=config.eval.linear_max_iter, seed=config.seed,
        backend="torch" if device is not None and device.type == "cuda" else "sklearn",
        device=device)
    return {metric_name(TRANSFER, LINEAR, name, stage=stage, transfer=transfer.name): value
            for name, value in scores["test"].items()}


__all__ = ["Features", "evaluate_features", "evaluate_transfer"]
