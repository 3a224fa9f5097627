"""Scoring a representation: probes, kNN and retrieval per split, transfer sets, diagnostics.

:func:`evaluate_epoch` is one evaluation of the worker loop: embed (every rank), integrate the
stages, score (rank 0). Probes are fit on the training split and score validation
(``val/...``: what a sweep selects on); after a stage's last epoch the test split and the
transfer sets too (``test/...``, ``transfer/...``), and at the trial's end the diagnostics.

A file stream mode cannot decode is embedded as a NaN row (:func:`raycl.worker.embed.embed_images`),
never as a blank image: the scoring leaves those rows out of the split's features and labels
together (:func:`decodable_rows`) and counts them (``data/eval_skipped``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from raycl.config.metric_names import (
    DATA,
    PERF,
    metric_name,
)
from raycl.config.schema import CoreConfig
from raycl.data import SPLITS, DatasetSplits, ImageSet
from raycl.data.augment import BatchAugment, to_float
from raycl.data.stream.files import FileRows
from raycl.distributed import CollectiveInSingleRankSection, single_rank_section
from raycl.eval.diagnostics import representation_diagnostics
from raycl.eval.multimodal import EvalSets, image_text_metrics
from raycl.eval.scoring import evaluate_features, evaluate_transfer
from raycl.eval.support_retrieval import neighbour_retrieval_accuracy
from raycl.methods.base import Batch, Method
from raycl.worker.embed import embed_images, embed_splits, integrate_stages
from raycl.worker.optim import inference_autocast
from raycl.worker.session import Session
from raycl.worker.stage_integration import Features, StageInputs, mcl_summary

logger = logging.getLogger(__name__)

# Test images a method's end-of-trial pictures are drawn from (FGVR's reconstruction triples).
DIAGNOSTIC_IMAGES = 8


def evaluate_epoch(
    config: CoreConfig,
    data: DatasetSplits,
    eval_sets: EvalSets,
    inputs: StageInputs,
    method: Method,
    session: Session,
    last: bool,
) -> tuple[Features, dict[str, float], dict[str, np.ndarray] | None]:
    """Embed (every rank) and score (rank 0) one evaluation: train and val; after a stage's last
    epoch also test and the transfer sets; at the trial's end the diagnostics. MMVP-style pair
    sets are embedded like splits (``mmvp:val``, ``mmvp:test``), so stages integrate them too.

    Returns:
        The features per split, the metrics (rank 0; timings on every rank), and the diagnostic
        arrays for the plots (rank 0 at the trial's end, else None).
    """
    device = session.device
    # The test split (and the transfer sets) are embedded and scored once per stage, after its
    # last epoch.
    splits = ("train", "val", "test") if last else ("train", "val")
    started = time.perf_counter()
    autocast = inference_autocast(config, device)  # the trial's precision on CUDA, none on CPU
    features = embed_splits(method, data, eval_sets, splits, session, last, autocast)
    integrated, integrated_method = integrate_stages(
        config, inputs, method, features,
        lambda model: embed_splits(model, data, eval_sets, splits, session, last, autocast))
    diagnose = last and inputs.stage == config.num_stages - 1 and config.eval.diagnostics
    projections = None
    if diagnose and type(method).project is not Method.project:
        projections = embed_images(method, data.test.images, session, embed=method.project,
                                   autocast=autocast)
    metrics: dict[str, float] = {
        metric_name(PERF, None, "embed_seconds"): time.perf_counter() - started}
    # Only stream mode's files are marked: elsewhere a NaN is the model's, not to be hidden.
    keep = {split: rows for split, rows
            in decodable_rows([features, integrated, {"test": projections}]).items()
            if isinstance(data.split(split).images, FileRows)}
    if keep:  # stream mode met files it could not decode: scored without them, and counted
        metrics[metric_name(DATA, None, "eval_skipped")] = float(
            sum(len(features[split]) - len(rows) for split, rows in keep.items()))
    # Clustering (MCL) and checkpoints need a row per image: an undecodable one's is zeros.
    stage_features = _finite(features) if keep else features
    diagnostics = None
    if session.rank == 0:
        started = time.perf_counter()
        if projections is not None and "test" in keep:
            projections = projections[keep["test"]]
        # Only rank 0 scores: a collective in here would wait forever for the other ranks.
        with single_rank_section("rank 0's scoring and diagnostics"):
            metrics.update(_stage_and_trial_metrics(
                config, _keep_rows(data, keep), inputs, _keep_features(features, keep),
                _keep_features(integrated, keep), device, eval_sets, method, integrated_method))
            # The method's support set indexes the whole training split: only queries are cut.
            queries = _keep_rows(data, {split: rows for split, rows in keep.items()
                                        if split != "train"})
            metrics.update(neighbour_retrieval_accuracy(
                method, queries, splits[1:], device,
                stage=inputs.stage if config.num_stages > 1 else None))
            if diagnose and data.attributes:
                diagnostics = _trial_diagnostics(config, _keep_rows(data, keep), method,
                                                 _keep_features(integrated, keep), projections,
                                                 metrics, device)
            if last and 0 < inputs.stage == config.num_stages - 1:  # MCL's figure's arrays
                diagnostics = {**(diagnostics or {}), **mcl_summary(
                    config, inputs, stage_features, metrics, device)}
        metrics[metric_name(PERF, None, "eval_seconds")] = time.perf_counter() - started
    return stage_features, metrics, diagnostics


def decodable_rows(embedded: Sequence[Mapping[str, np.ndarray | None]]) -> dict[str, np.ndarray]:
    """For each split (train, val, test) with a NaN row in any of ``embedded`` (a file stream
    mode could not decode: :func:`raycl.worker.embed.embed_images`), the rows to score, sorted;
    splits without one are absent (nothing to leave out)."""
    keep: dict[str, np.ndarray] = {}
    for values in embedded:
        for split in SPLITS:
            array = values.get(split)
            if array is None:
                continue
            finite = np.isfinite(array).all(axis=1)
            if split in keep:
                finite[np.setdiff1d(np.arange(len(finite)), keep[split])] = False
            if not finite.all():
                keep[split] = np.flatnonzero(finite)
    return keep


def _keep_rows(data: DatasetSplits, keep: dict[str, np.ndarray]) -> DatasetSplits:
    """``data`` with each split of ``keep`` cut to those rows: images, labels and captions."""
    def rows_of(part: ImageSet, rows: np.ndarray) -> ImageSet:
        images = part.images
        return ImageSet(images=images.subset(rows) if isinstance(images, FileRows)
                        else np.asarray(images[rows]),
                        labels={name: values[rows] for name, values in part.labels.items()},
                        captions=None if part.captions is None else part.captions[rows])

    if not keep:
        return data
    return dataclasses.replace(data, **{split: rows_of(data.split(split), rows)
                                        for split, rows in keep.items()})


def _keep_features(features: Features, keep: dict[str, np.ndarray]) -> Features:
    """``features`` with each split of ``keep`` cut to those rows (other keys as they are)."""
    return {key: values[keep[key]] if key in keep else values
            for key, values in features.items()}


def _finite(features: Features) -> Features:
    """``features`` with NaN rows (undecodable files) as zeros."""
    return {key: np.nan_to_num(values, nan=0.0) for key, values in features.items()}


def _stage_and_trial_metrics(
    config: CoreConfig,
    data: DatasetSplits,
    inputs: StageInputs,
    features: Features,
    integrated: Features,
    device: torch.device,
    eval_sets: EvalSets,
    method: Method,
    integrated_method: Method,
) -> dict[str, float]:
    """This stage's encoder alone, and (MCL) the integration of the stages so far
    (concatenated features, or the model soup's).

    The integrated representation is the trial's result: its test split and transfer sets are
    scored only after the last stage, so every trial scores them exactly once.
    """

    def scores(values: Features, stage: int | None, model: Method) -> dict[str, float]:
        metrics = evaluate_features(config, data, values, stage, device) \
            if data.attributes else {}
        if "test" in values:  # a stage's last epoch: the transfer sets were embedded too
            metrics.update(evaluate_transfer(config, eval_sets.transfer, values, stage,
                                             device))
        if type(model).multimodal:
            metrics.update(image_text_metrics(model, data, values, eval_sets.mmvp, stage,
                                              device, config.eval.mmvp_direction))
        return metrics

    if config.num_stages == 1:
        return scores(features, None, method)
    metrics = scores(features, inputs.stage, method)
    if inputs.stage < config.num_stages - 1:
        integrated = {split: values for split, values in integrated.items()
                      if split in ("train", "val", "mmvp:val")}
    return {**metrics, **scores(integrated, None, integrated_method)}


def _trial_diagnostics(
    config: CoreConfig,
    data: DatasetSplits,
    method: Method,
    integrated: Features,
    projections: np.ndarray | None,
    metrics: dict[str, Any],
    device: torch.device,
) -> dict[str, np.ndarray] | None:
    """The end-of-trial ``diag/*`` metrics (added to ``metrics``) and picture arrays.

    Extras: when they fail (a LAPACK SVD that does not converge), the trial keeps its results
    and the diagnostics are None; a collective entered here is a bug, and is raised.
    """
    try:
        diag_metrics, diagnostics = representation_diagnostics(
            integrated["test"], data.test.labels[data.attributes[0]], projections)
        diagnostics.update(method_diagnostics(config, data, method, device))
        metrics.update(diag_metrics)
    except CollectiveInSingleRankSection:
        raise
    except Exception:  # extras: a failure here must not cost the trial its results
        logger.exception("end-of-trial diagnostics failed; the trial's results are kept")
        return None
    return diagnostics


def method_diagnostics(
    config: CoreConfig, data: DatasetSplits, method: Method, device: torch.device
) -> dict[str, np.ndarray]:
    """The method's picture arrays (:meth:`Method.diagnostic_arrays`) on the first test images,
    with two augmented views each, the model in eval mode."""
    images = torch.from_numpy(data.test.images[:DIAGNOSTIC_IMAGES]).to(device)
    generator = torch.Generator(device=device)
    generator.manual_seed(config.seed)
    augment = BatchAugment(config.augment)
    batch = Batch(images=to_float(images),
                  views=[augment(images, generator), augment(images, generator)],
                  index=torch.arange(len(images), device=device))
    was_training = method.training
    method.eval()
    try:
        return method.diagnostic_arrays(batch)
    finally:
        method.train(was_training)


__all__ = ["DIAGNOSTIC_IMAGES", "evaluate_epoch", "method_diagnostics"]
