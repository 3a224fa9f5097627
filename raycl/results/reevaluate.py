"""Re-evaluation: finished trials' encoders scored on new data, without retraining (the work of
``python -m raycl.evaluate``, whose door is :mod:`raycl.evaluate`).

A sweep's trials are found from MLflow (:func:`raycl.results.trials.find_trials`: ``best``, a
run name such as ``t07``, a run id, or the ``--top K``); each one's trained encoder is rebuilt
from its last checkpoint (:func:`raycl.export.encoder.trained_encoder`) and frozen. The new data
is any dataset raycl reads, given as ``--set data.dataset=folder --set data.root=DIR``; it is
read as a transfer set is (:func:`raycl.eval.transfer.load_transfer_sets`: at the trial's
resolution, converted to its channels, split into a probe-training share and a held-out share),
and scored as a trial's own splits are (:func:`raycl.eval.scoring.evaluate_features`: the
closed-form linear probe, kNN, retrieval, ``eval.label_fractions``; ``eval.linear_sgd`` when
set). The scores are logged into each trial's own MLflow run as
``transfer/<name>/<family>/<attribute>``, beside the sweep's metrics.

Each trial is one Ray task (a GPU where the cluster has one); ``--no-ray`` scores in this
process. :func:`score_trial` imports no Ray. Beside the trial's encoder it scores its
references, the untrained encoder and the raw pixels (:mod:`raycl.results.references`;
``--no-references``: not). ``--features-out DIR`` writes each share's features, labels and image
ids (:mod:`raycl.results.new_data`) as ``.npy`` for people who only want the embeddings.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import numpy as np
import torch
from pydantic import ValidationError
from torch import nn

from raycl.config.evaluation import TransferConfig
from raycl.config.metric_names import TEST, TRANSFER, MetricName, maybe_metric
from raycl.config.schema import ConfigError, ConfigErrors, CoreConfig
from raycl.config.training import DataConfig
from raycl.data import DatasetSplits, stratified_subset
from raycl.eval.transfer import transfer_data_config
from raycl.results.new_data import NewData, load_new_data

if TYPE_CHECKING:
    from raycl.results.trials import FinishedTrial

# ``--set data.<key>`` keys the new data takes: those of a transfer set. The rest of ``data``
# is the trained encoder's (resolution, channels) and cannot change.
DATA_KEYS: tuple[str, ...] = ("dataset", "root", "samples_per_combination", "num_samples",
                              "test_fraction")
# Images per forward when embedding.
EMBED_BATCH = 256
# Share of the probe-training rows eval.linear_sgd chooses its learning rate on (the new data
# has no validation split; the held-out share is read once, after the choice).
SGD_VAL_SHARE = 0.2


class UnscorableDataError(ValueError):
    """The new data cannot score an encoder (no labels); the message is one line."""


@dataclass(frozen=True)
class TrialScores:
    """One trial's evaluation on the new data.

    Attributes:
        metrics: ``transfer/<name>/...`` -> score.
        features: ``train``/``test`` -> (N, D) float32 features (empty unless asked for).
        labels: ``train``/``test`` -> attribute -> (N,) int64 labels (as ``features``).
        ids: ``train``/``test`` -> (N,) image ids, file paths or rows (as ``features``).
        notes: references not scored, and why (one line each).
    """

    metrics: dict[str, float]
    features: dict[str, np.ndarray]
    labels: dict[str, dict[str, np.ndarray]]
    ids: dict[str, np.ndarray] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def split_overrides(overrides: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``--set key=value`` texts as the new data's keys and the evaluation's.

    Args:
        overrides: ``data.<key>=value`` (a key of :data:`DATA_KEYS`) or ``eval.<key>=value``.

    Returns:
        (transfer-set fields -> value, dotted ``eval.`` key -> value).

    Raises:
        ConfigErrors: one line per bad ``--set``.
    """
    from raycl.config.search_config import config_keys, did_you_mean
    from raycl.launch.load import parse_override

    data: dict[str, Any] = {}
    evaluation: dict[str, Any] = {}
    lines: list[str] = []
    for text in overrides:
        try:
            key, value = parse_override(text)
        except ConfigError as exc:
            lines.append(str(exc))
            continue
        section, _, field = key.partition(".")
        if section == "data" and field in DATA_KEYS:
            data[field] = value
        elif section == "data":
            lines.append(f"--set {key}: not a key of the new data ({', '.join(DATA_KEYS)}); "
                         f"the rest of data is the trained encoder's")
        elif key == "eval.transfer":  # the new data is the one transfer set scored
            lines.append(f"--set {key}: give the data to evaluate on as --set data.dataset=... "
                         f"(one dataset a command)")
        elif section == "eval" and key in config_keys():
            evaluation[key] = value
        else:
            lines.append(f"--set {key}: not a data.* or eval.* key{did_you_mean(key)}")
    if "dataset" not in data and not lines:
        lines.append("--set data.dataset: required: the data to evaluate on (e.g. --set "
                     "data.dataset=folder --set data.root=DIR)")
    if lines:
        raise ConfigErrors(lines)
    return data, evaluation


def _validation_line(exc: ValidationError, prefix: str) -> list[str]:
    """A pydantic error per line, as ``--set <prefix><key>: why``."""
    lines = []
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        # A model-level check (folder without root) has no key: the section is named.
        lines.append(f"--set {prefix}{key}: {message}" if key else
                     f"--set {prefix.rstrip('.') or '(top level)'}: {message}")
    return lines


def _transfer_entry(data: Mapping[str, Any], name: str | None) -> TransferConfig:
    """The new data as a transfer set: any dataset ``data.dataset`` takes (``eval.transfer``
    lists fewer; their files are checked by the reader, :func:`evaluation_config`).

    Raises:
        ConfigErrors: one line per bad key.
    """
    dataset = data.get("dataset")
    readable = get_args(DataConfig.model_fields["dataset"].annotation)
    transferable = get_args(TransferConfig.model_fields["dataset"].annotation)
    if dataset not in readable:
        raise ConfigErrors([f"--set data.dataset: expected one of {', '.join(readable)} "
                            f"(got {dataset!r})"])
    # Validated as a transfer set of a dataset it lists, then given the dataset asked for.
    stand_in = dataset if dataset in transferable else "trifeature"
    try:
        entry = TransferConfig.model_validate({**data, "dataset": stand_in, "name": name})
    except ValidationError as exc:
        raise ConfigErrors(_validation_line(exc, "data.")) from None
    return entry.model_copy(update={"dataset": dataset})


def evaluation_config(
    trial_config: CoreConfig,
    data: Mapping[str, Any],
    evaluation: Mapping[str, Any],
    name: str | None,
) -> CoreConfig:
    """The trial's config with the ``eval.`` overrides and the new data as its one transfer set.

    Checked as ``raycl.tune`` checks a config before launch: the schema's validation, then the
    data reader's check of the new data's files (a folder that is not there).

    Args:
        trial_config: the finished trial's configuration.
        data: the new data's transfer-set fields (:func:`split_overrides`).
        evaluation: dotted ``eval.`` keys -> values.
        name: the name in ``transfer/<name>/...`` (None: the dataset's).

    Returns:
        The config whose ``eval.transfer`` is the new data alone.

    Raises:
        ConfigErrors: one line per problem, naming the ``--set`` key.
    """
    from raycl.config.search_config import apply_overrides
    from raycl.launch.checks import dataset_problems

    entry = _transfer_entry(data, name)
    try:
        config = apply_overrides(trial_config, evaluation) if evaluation else trial_config
    except ValidationError as exc:
        raise ConfigErrors(_validation_line(exc, "")) from None
    # Set after validation: eval.transfer's schema lists fewer datasets than raycl reads.
    config = config.model_copy(update={"eval": config.eval.model_copy(
        update={"transfer": [entry]})})
    problems = list(dataset_problems(transfer_data_config(config, entry), "data"))
    if problems:
        raise ConfigErrors([f"--set {problem.key}: {problem.why}" for problem in problems])
    return config


def embed(encoder: nn.Module, images: Any, device: torch.device) -> np.ndarray:
    """Features of uint8 (N, C, H, W) images as a trial's evaluation embeds them
    (:func:`raycl.worker.embed.embed_images`, in this one process, float32).

    Args:
        encoder: normalised float images -> (B, D) features.
        images: uint8 (N, C, H, W), read ``EMBED_BATCH`` rows at a time.
        device: where the forward runs.

    Returns:
        float32 (N, D).
    """
    from raycl.worker.embed import OneProcess, embed_images

    features = embed_images(encoder, images, OneProcess(device), batch_size=EMBED_BATCH,
                            embed=encoder)
    assert features is not None  # a process of its own is rank 0
    return features


def as_transfer(metrics: Mapping[str, float], name: str) -> dict[str, float]:
    """``test/<family>/<x>`` scores renamed ``transfer/<name>/<family>/<x>``; others dropped
    (validation scores and learning-rate diagnostics say nothing of the new data).

    Args:
        metrics: reported names -> values.
        name: the transfer set's name.

    Returns:
        The held-out share's scores under the transfer names.
    """
    renamed = {}
    for text, value in metrics.items():
        parts = maybe_metric(text)
        if parts is None or parts.split != TEST:
            continue
        renamed[MetricName(TRANSFER, parts.family, parts.name, parts.stage, parts.percent,
                           name).format()] = float(value)
    return renamed


def _linear_sgd_scores(config: CoreConfig, encoder: nn.Module, splits: DatasetSplits,
                       device: torch.device) -> dict[str, float]:
    """``eval.linear_sgd`` on the new data: its learning rate chosen on a seeded stratified
    share of the probe-training rows, the heads trained on the rest, the held-out share scored
    once; ``test/linear_sgd/...`` names."""
    from raycl.eval.linear_sgd import (
        FrozenEncoder,
        LabelledImages,
        evaluate_linear_sgd,
        linear_sgd_metrics,
    )
    from raycl.worker.embed import select_images

    settings = config.eval.linear_sgd
    if settings is None:
        return {}
    first = splits.train.labels[splits.attributes[0]]
    val_rows = stratified_subset(first, max(1, round(SGD_VAL_SHARE * len(first))),
                                config.data_seed)
    train_rows = np.setdiff1d(np.arange(len(first)), val_rows)

    def rows_of(rows: np.ndarray) -> LabelledImages:
        # A view of those rows (read a batch at a time), never a copy of the set: an
        # ImageNet-size folder is hundreds of GB.
        return LabelledImages(select_images(splits.train.images, rows),  # type: ignore[arg-type]
                              {name: labels[rows] for name, labels
                               in splits.train.labels.items()})

    results = evaluate_linear_sgd(
        FrozenEncoder(model=encoder, embed=encoder), rows_of(train_rows), rows_of(val_rows),
        lambda: LabelledImages(splits.test.images, splits.test.labels),
        {name: splits.num_classes[name] for name in splits.attributes}, settings, device,
        config.seed)
    return linear_sgd_metrics(results)


def score_encoder(config: CoreConfig, encoder: nn.Module, data: NewData, device: torch.device,
                  keep_features: bool = False) -> TrialScores:
    """Score a frozen encoder on the new data.

    Args:
        config: :func:`evaluation_config`'s result.
        encoder: normalised float images -> features, in eval mode, on ``device``.
        data: the new data (:func:`raycl.results.new_data.load_new_data`), at the encoder's
            channels.
        device: where embedding and the probes run.
        keep_features: return the features, labels and ids too (``--features-out``).

    Returns:
        The ``transfer/<name>/...`` scores (and the features when asked).
    """
    from raycl.eval.scoring import evaluate_features

    splits = data.splits
    if not splits.attributes:
        raise UnscorableDataError(f"--set data.dataset: {data.name} has no labels to score "
                                  f"the encoder on")
    features = {"train": embed(encoder, splits.train.images, device),
                "test": embed(encoder, splits.test.images, device)}
    scores = evaluate_features(config, splits, features, device=device)
    scores.update(_linear_sgd_scores(config, encoder, splits, device))
    if not keep_features:
        return TrialScores(as_transfer(scores, data.name), {}, {})
    labels = {"train": dict(splits.train.labels), "test": dict(splits.test.labels)}
    return TrialScores(as_transfer(scores, data.name), features, labels, data.ids)


def with_references(scores: TrialScores, config: CoreConfig, data: NewData, channels: int,
                    device: torch.device) -> TrialScores:
    """``scores`` and its references' (:mod:`raycl.results.references`: the untrained encoder,
    the pixels), each under ``transfer/<name>/<reference>/...``; one not scored is a note.

    Args:
        scores: the trial's encoder's scores.
        config: the trial's config with the new data.
        data: the new data, as the trial's encoder read it.
        channels: that encoder's image channels.
        device: where they run.
    """
    from raycl.results.references import reference_encoders, reference_metrics

    metrics, notes = dict(scores.metrics), list(scores.notes)
    for reference, encoder, why in reference_encoders(config, channels, data.splits):
        if encoder is None:
            notes.append(f"{reference}: not scored ({why})")
            continue
        found = score_encoder(config, encoder.to(device).eval(), data, device)
        metrics.update(reference_metrics(found.metrics, data.name, reference))
    return TrialScores(metrics, scores.features, scores.labels, scores.ids, tuple(notes))


def score_trial(trial: FinishedTrial, config: CoreConfig, keep_features: bool = False,
                device: str | None = None, references: bool = True) -> TrialScores:
    """One trial's encoder, rebuilt from its last checkpoint and scored (no Ray: a Ray task
    runs this on a worker, ``--no-ray`` in this process).

    Args:
        trial: the finished trial.
        config: the trial's config with the new data (:func:`evaluation_config`).
        keep_features: return the features, labels and ids too.
        device: where to run (None: the GPU when there is one).
        references: score the untrained encoder and the pixels too (:func:`with_references`).

    Returns:
        Its :class:`TrialScores`.
    """
    from raycl.results.run_encoder import evaluation_encoder

    where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with tempfile.TemporaryDirectory(prefix="raycl-evaluate-") as scratch:
        # Its checkpoint, else (gone) the encoder the sweep logged into its run.
        encoder, channels = evaluation_encoder(trial, Path(scratch))
    encoder = encoder.to(where).eval()
    data = load_new_data(config, channels, with_ids=keep_features)  # read once for all
    scores = score_encoder(config, encoder, data, where, keep_features)
    return with_references(scores, config, data, channels, where) if references else scores


def check_checkpoint(trial: FinishedTrial) -> None:
    """A local checkpoint that holds no ``state.pt`` is refused here, before anything runs (a
    bucket's is read by the task that scores it).

    Raises:
        TrialLookupError: the checkpoint directory is gone or holds no ``state.pt``.
    """
    from raycl.data.bucket_paths import is_remote
    from raycl.results.trials import local_checkpoint

    if not is_remote(trial.checkpoint) and not trial.encoder:  # logged encoder: read instead
        local_checkpoint(trial, Path(trial.checkpoint))  # local: nothing is copied


def write_features(scores: TrialScores, into: Path) -> None:
    """``<into>/{train,test}_features.npy`` (float32 (N, D)),
    ``{train,test}_labels_<attribute>.npy`` (int64 (N,)) and ``{train,test}_ids.npy`` (N,): row
    ``i`` of each is image ``ids[i]``, a path relative to ``data.root`` (str) or a row of the
    set as raycl reads it (int64)."""
    into.mkdir(parents=True, exist_ok=True)
    for split, values in scores.features.items():
        np.save(into / f"{split}_features.npy", values)
        if split in scores.ids:  # str paths: a unicode array, read without pickle
            np.save(into / f"{split}_ids.npy", scores.ids[split])
        for attribute, labels in scores.labels[split].items():
            np.save(into / f"{split}_labels_{attribute}.npy", np.asarray(labels, dtype=np.int64))


def log_scores(tracking_uri: str, run_id: str, metrics: Mapping[str, float]) -> None:
    """Log ``metrics`` into the trial's own MLflow run (beside the sweep's)."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    stamp = int(time.time() * 1000)
    MlflowClient(tracking_uri).log_batch(
        run_id, metrics=[Metric(key, value, stamp, 0) for key, value in sorted(metrics.items())])


def score_with_ray(jobs: Sequence[tuple[FinishedTrial, CoreConfig]], keep_features: bool,
                   address: str | None, references: bool = True) -> list[TrialScores]:
    """One Ray task per trial, on a GPU where the cluster has one; Ray is joined or started
    as ``raycl.tune`` does (:func:`raycl.sweep.local_ray.init_ray`)."""
    import ray

    from raycl.results.trials import TrialLookupError
    from raycl.sweep.local_ray import init_ray

    init_ray(quiet=True, address=address)
    gpus = ray.cluster_resources().get("GPU", 0) > 0
    task = ray.remote(score_trial).options(num_gpus=1 if gpus else 0, num_cpus=1)
    try:
        return ray.get([task.remote(trial, config, keep_features, None, references)
                        for trial, config in jobs])
    except ray.exceptions.RayTaskError as exc:
        # A bucket checkpoint gone, data without labels: one line, as in this process.
        if isinstance(exc.cause, TrialLookupError | UnscorableDataError):
            raise exc.cause from None
        raise
