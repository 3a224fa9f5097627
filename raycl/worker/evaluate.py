"""Scoring a representation: probes, kNN and retrieval per split, transfer sets, diagnostics.

:func:`evaluate_epoch` is one evaluation of the worker loop: embed (every rank; the features
are gathered on rank 0 alone), integrate the stages and score (rank 0). Probes are fit on the
training split and score validation (``val/...``: what a sweep selects on); after a stage's
last epoch the test split and the transfer sets too (``test/...``, ``transfer/...``), and at the
trial's end the diagnostics.

A file stream mode cannot decode is embedded as a NaN row (:func:`raycl.worker.embed.embed_images`),
never as a blank image: the scoring leaves those rows out of the split's features and labels
together (:func:`decodable_rows`) and counts them (``data/eval_skipped``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from functools import partial
from typing import Any

import numpy as np
import torch

from raycl.config.metric_names import (
    DATA,
    PERF,
    metric_name,
)
from raycl.config.schema import CoreConfig
from raycl.data import SPLITS, DatasetSplits, ImageSet, stratified_subset
from raycl.data.augment import BatchAugment, to_float
from raycl.data.stream.files import FileRows
from raycl.data.stream.shards import ShardRows
from raycl.distributed import CollectiveInSingleRankSection, barrier_after, single_rank_section
from raycl.eval.diagnostics import representation_diagnostics
from raycl.eval.label_free import label_free_scores
from raycl.eval.multimodal import EvalSets, image_text_metrics
from raycl.eval.scoring import evaluate_features, evaluate_transfer
from raycl.eval.support_retrieval import neighbour_retrieval_accuracy
from raycl.methods.base import Batch, Method
from raycl.worker.embed import (
    FileDecoder,
    embed_images,
    embed_splits,
    integrate_stages,
    select_images,
)
from raycl.worker.linear_eval import linear_sgd_evaluation
from raycl.worker.optim import inference_autocast
from raycl.worker.session import Session
from raycl.worker.stage_integration import Features, StageInputs, mcl_summary

logger = logging.getLogger(__name__)

# Test images a method's end-of-trial pictures are drawn from (FGVR's reconstruction triples).
DIAGNOSTIC_IMAGES = 8
# How long the other ranks wait for rank 0's scoring of one evaluation (a paper-scale test split's
# probes, kNN and end-of-trial diagnostics on one process).
SCORING_WAIT = timedelta(hours=6)


def evaluate_epoch(
    config: CoreConfig,
    data: DatasetSplits,
    eval_sets: EvalSets,
    inputs: StageInputs,
    method: Method,
    session: Session,
    last: bool,
) -> tuple[Features, dict[str, float], dict[str, np.ndarray] | None]:
    """Embed (every rank, gathered on rank 0) and score (rank 0) one evaluation: val, and train
    where something reads it; after a stage's last epoch also test and the transfer sets; at the
    trial's end the diagnostics and ``eval.linear_sgd`` (every rank, on every row of its splits
    whatever the caps below: :func:`raycl.worker.linear_eval.linear_sgd_evaluation`). MMVP-style
    pair sets are embedded like splits (``mmvp:val``, ``mmvp:test``), so stages integrate them
    too. The other ranks wait for rank 0's scoring in a gloo barrier of :data:`SCORING_WAIT`,
    never in a collective of the default group, whose watchdog would abort the trial.

    Only the rows scored are embedded: the probe's capped training rows
    (``eval.max_train_samples``) and val/test capped by ``eval.max_eval_samples``
    (:func:`scored_subset`), except that MCL clusters every training row after a stage's last
    epoch. A run with nothing to fit on the training split (no attributes: no probe, no kNN)
    embeds none of it, but for that clustering.

    Returns:
        The features per split (rank 0; ``{}`` on every other rank), the metrics (rank 0;
        timings on every rank), and the diagnostic arrays for the plots (rank 0 at the trial's
        end, else None).
    """
    device = session.device
    clustered = last and config.num_stages > 1  # MCL clusters every training row
    splits = (("train",) if clustered or data.attributes else ()) + (
        ("val", "test") if last else ("val",))  # test and transfer: once per stage, at its end
    scored_rows = {split: scored_subset(config, data, split) for split in splits}
    embedded_rows = {**scored_rows, "train": None} if clustered else scored_rows
    started = time.perf_counter()
    autocast = inference_autocast(config, device)  # the trial's precision on CUDA, none on CPU
    decode_files = file_decoder(config)
    features = embed_splits(method, data, eval_sets, splits, session, last, autocast,
                            embedded_rows, decode_files)
    # The training rows the probe reads (none without attributes: only the clustering does).
    scored = {key: values for key, values
              in _at_scored_rows(features, scored_rows, embedded_rows).items()
              if key != "train" or data.attributes}
    integrated, integrated_method = integrate_stages(
        config, inputs, method, scored,
        lambda model: embed_splits(model, data, eval_sets, splits, session, last, autocast,
                                   scored_rows, decode_files), scored_rows)
    scored_data = select_splits(data, scored_rows)
    diagnose = last and inputs.stage == config.num_stages - 1 and config.eval.diagnostics
    projections = None
    if diagnose and type(method).project is not Method.project:
        projections = embed_images(method, scored_data.test.images, session,
                                   embed=method.project, autocast=autocast,
                                   decode_files=decode_files)
    metrics: dict[str, float] = {
        metric_name(PERF, None, "embed_seconds"): time.perf_counter() - started}
    diagnostics = None
    # The other ranks wait for rank 0's scoring here, outside the default group's watchdog
    # (scaling.collective_timeout_s): scoring a paper-scale split takes longer, and their next
    # collective (the papers' probe, the next epoch's first all_reduce) would abort the group.
    with barrier_after(SCORING_WAIT):
        if session.rank == 0:
            started = time.perf_counter()
            # Only rank 0 scores: a collective in here would wait forever for the other ranks.
            with single_rank_section("rank 0's scoring and diagnostics"):
                diagnostics = _score(config, data, scored_data, scored_rows, eval_sets, inputs,
                                     (features, scored, integrated, projections),
                                     (method, integrated_method), device, last, metrics)
            metrics[metric_name(PERF, None, "eval_seconds")] = time.perf_counter() - started
    if last and inputs.stage == config.num_stages - 1:  # the trial's end: the papers' probe
        # Every row of its splits, whatever the closed-form probe's caps: the papers' number.
        metrics.update(linear_sgd_evaluation(config, data, method, session))
    return features, metrics, diagnostics


def _score(
    config: CoreConfig,
    data: DatasetSplits,
    scored_data: DatasetSplits,
    scored_rows: Mapping[str, np.ndarray | None],
    eval_sets: EvalSets,
    inputs: StageInputs,
    embedded: tuple[Features, Features, Features, np.ndarray | None],
    methods: tuple[Method, Method],
    device: torch.device,
    last: bool,
    metrics: dict[str, float],
) -> dict[str, np.ndarray] | None:
    """Rank 0's part of :func:`evaluate_epoch`: the metrics (added to ``metrics``) and the
    diagnostic arrays. ``embedded``: the features as embedded, at the scored rows, integrated,
    and the test split's projections; ``methods``: this stage's and the integrated one."""
    features, scored, integrated, projections = embedded
    method, integrated_method = methods
    # Only stream mode's files and shards are marked: elsewhere a NaN is the model's.
    keep = {split: rows for split, rows
            in decodable_rows([scored, integrated, {"test": projections}]).items()
            if isinstance(scored_data.split(split).images, FileRows | ShardRows)}
    if keep:  # stream mode met files it could not decode: scored without them, and counted
        metrics[metric_name(DATA, None, "eval_skipped")] = float(
            sum(len(scored[split]) - len(rows) for split, rows in keep.items()))
    if projections is not None and "test" in keep:
        projections = projections[keep["test"]]
    kept = _keep_rows(scored_data, keep)
    if data.attributes:  # what the leaderboard reads val's scores against (cheap: counts)
        metrics.update(val_reference_metrics(kept.val.labels))
    metrics.update(_stage_and_trial_metrics(
        config, kept, inputs, _keep_features(scored, keep), _keep_features(integrated, keep),
        device, eval_sets, method, integrated_method))
    # The method's support set indexes the whole training split: only queries are cut.
    held_out = {split: rows for split, rows in scored_rows.items() if split != "train"}
    queries = _keep_rows(select_splits(data, held_out),
                         {split: rows for split, rows in keep.items() if split != "train"})
    splits = tuple(split for split in ("val", "test") if split in scored)
    metrics.update(neighbour_retrieval_accuracy(
        method, queries, splits, device,
        stage=inputs.stage if config.num_stages > 1 else None))
    diagnostics = None
    if last and inputs.stage == config.num_stages - 1 and config.eval.diagnostics \
            and data.attributes:
        diagnostics = _trial_diagnostics(config, kept, method, _keep_features(integrated, keep),
                                         projections, metrics, device)
    if any(isinstance(data.split(split).images, FileRows | ShardRows) for split in features
           if split in SPLITS):
        # Clustering (MCL) and checkpoints need a row per image: an undecodable one's is zeros
        # (in place, once scored: no second copy of the features).
        for values in features.values():
            np.nan_to_num(values, copy=False, nan=0.0)
    if last and 0 < inputs.stage == config.num_stages - 1:  # MCL's figure's arrays
        diagnostics = {**(diagnostics or {}), **mcl_summary(
            config, inputs, features, metrics, device)}
    return diagnostics


def val_reference_metrics(labels: Mapping[str, np.ndarray]) -> dict[str, float]:
    """What the leaderboard reads val's accuracies against: ``data/val_size`` (the val rows
    scored) and ``data/chance/<attribute>``, the majority class's share of them (the accuracy
    of always answering the most frequent class; 1/num_classes only when balanced).

    Args:
        labels: the scored val rows' labels per attribute.

    Returns:
        The metrics; ``{}`` for no rows.
    """
    counts = {name: np.unique(values, return_counts=True)[1] for name, values in labels.items()}
    size = len(next(iter(labels.values()))) if labels else 0
    if size == 0:
        return {}
    metrics = {metric_name(DATA, None, "val_size"): float(size)}
    metrics.update({metric_name(DATA, "chance", name): float(found.max() / size)
                    for name, found in counts.items()})
    return metrics


def file_decoder(config: CoreConfig) -> FileDecoder | None:
    """Where an evaluation decodes stream mode's files: with training's decoders, in this
    worker's own bundle (``data.stream_cpus`` of it), when it holds one; else None (in this
    process: a test, a script, a worker that reserved no decoder CPUs)."""
    if config.data.loader != "stream" or config.data.stream_cpus <= 0:
        return None
    from raycl.worker.stream_loader import decoded_row_batches, decoder_bundle

    if decoder_bundle() is None:
        return None
    return partial(decoded_row_batches, decoder_cpus=config.data.stream_cpus)


def scored_subset(config: CoreConfig, data: DatasetSplits, split: str) -> np.ndarray | None:
    """The rows of ``split`` an evaluation embeds and scores, sorted: a seeded subset stratified
    on the first attribute (:func:`raycl.data.stratified_subset`) when ``eval.max_train_samples``
    (train) or ``eval.max_eval_samples`` (val, test) caps the split, the same rows at every
    evaluation of a trial; None (every row) otherwise."""
    cap = config.eval.max_train_samples if split == "train" else config.eval.max_eval_samples
    part = data.split(split)
    count = len(part.images)
    if cap is None or cap >= count:
        return None
    # An unlabelled split (an image-text corpus) is one class: a seeded sample of its rows.
    labels = (part.labels[data.attributes[0]] if data.attributes
              else np.zeros(count, dtype=np.int64))
    return stratified_subset(labels, cap, config.data_seed)


def select_splits(
    data: DatasetSplits, rows: Mapping[str, np.ndarray | None]
) -> DatasetSplits:
    """``data`` with each split of ``rows`` cut to those rows (None: all), images as views
    (:func:`raycl.worker.embed.select_images`, nothing decoded or copied), labels and captions
    as copies."""
    def rows_of(part: ImageSet, picked: np.ndarray) -> ImageSet:
        return ImageSet(images=select_images(part.images, picked),  # type: ignore[arg-type]
                        labels={name: values[picked] for name, values in part.labels.items()},
                        captions=None if part.captions is None else part.captions[picked])

    cut = {split: rows_of(data.split(split), picked) for split, picked in rows.items()
           if picked is not None}
    return dataclasses.replace(data, **cut) if cut else data


def _at_scored_rows(
    features: Features,
    scored_rows: Mapping[str, np.ndarray | None],
    embedded_rows: Mapping[str, np.ndarray | None],
) -> Features:
    """``features`` at the rows the scoring reads: a split embedded whole for another reader
    (MCL's clustering) cut to its scored subset."""
    return {key: values[scored_rows[key]]
            if scored_rows.get(key) is not None and embedded_rows.get(key) is None else values
            for key, values in features.items()}


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
        return ImageSet(images=images.subset(rows)  # type: ignore[arg-type]
                        if isinstance(images, FileRows | ShardRows) else np.asarray(images[rows]),
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
        if config.eval.label_free:
            metrics.update(label_free_scores(values, stage=stage,
                                             max_rows=config.eval.label_free_rows,
                                             seed=config.seed))
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
            integrated["test"], data.test.labels[data.attributes[0]], projections, device)
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
                  views=[augment(images, generator, view=0),
                         augment(images, generator, view=1)],
                  index=torch.arange(len(images), device=device))
    was_training = method.training
    method.eval()
    try:
        return method.diagnostic_arrays(batch)
    finally:
        method.train(was_training)


__all__ = ["DIAGNOSTIC_IMAGES", "evaluate_epoch", "method_diagnostics", "scored_subset",
           "select_splits", "val_reference_metrics"]
