"""What one MCL stage hands to the next, and how stages are combined.

Two integrations (``mcl.integration``): ``concat`` (the paper's) concatenates the stages'
L2-normalised features; ``soup`` averages the stages' weights into one model of the size of one
stage (model soup, Wortsman et al. 2022; MCL appendix A.4), which needs every stage to start from
the same weights. A finished stage hands on its :data:`StageWeights` (:func:`kept_weights`): its
share of the soup, or, for ``concat``, its encoder's state, so the trial's whole encoder can be
rebuilt from its last checkpoint (:mod:`raycl.export`).

Between stages the training features of stage j are clustered into K groups (faiss k-means) and
every sample's pseudo label is extended by its group, so stage j+1's fresh encoder only contrasts
samples that earlier stages could not tell apart (feature-aware negatives). A stage's checkpoint
carries a :class:`StageInputs` (the clusterings and final metrics of every earlier stage, and
their frozen features: written once per stage into the run's storage and referenced by a
:class:`FeatureRef`, or, with no run storage, inline), so a trial resumed in stage j has stages
0..j-1 intact.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from raycl.config.metric_names import LINEAR, TEST, maybe_metric
from raycl.distributed import CollectiveInSingleRankSection
from raycl.kmeans import (
    ami_matrix,
    group_size_histogram,
    kmeans,
    kmeans_gpu,
    l2_normalize,
    pseudo_label_codes,
)

if TYPE_CHECKING:
    from raycl.config.schema import CoreConfig
    from raycl.methods.base import Method

# Files of a raycl checkpoint directory (written by raycl.worker.checkpoints).
STATE_FILE = "state.pt"
PROGRESS_FILE = "progress.json"
FEATURES_FILE = "features.npz"
METRICS_FILE = "metrics.json"
STAGE_INPUTS_FILE = "stage_inputs.npz"
# Beside STAGE_INPUTS_FILE: the earlier stages' kept weights (soup shares, or concat encoders).
STAGE_WEIGHTS_FILE = "stage_weights.pt"
DIAGNOSTICS_FILE = "diagnostics.npz"  # end of trial: spectra and principal angles, for plots
# Folder of the run's storage (beside its checkpoints) with each finished stage's features,
# written once and referenced by later checkpoints (:class:`FeatureRef`).
STAGE_FEATURES_DIR = "stage_features"
# Entries of DIAGNOSTICS_FILE with MCL's end-of-trial summary (:func:`mcl_summary`).
MCL_AMI = "mcl_ami"
MCL_GROUP_SIZES = "mcl_group_sizes"
MCL_STAGE_METRICS = "mcl_stage_metrics"

logger = logging.getLogger(__name__)


# Split name ("train", "val", "test", and "transfer:<name>:train|test" after a stage's last
# epoch) -> (N_split, D) features of one stage.
Features = dict[str, np.ndarray]
# State-dict entries of one stage's model that a soup averages: the trained parameters and the
# floating-point buffers (frozen parameters are the same in every stage).
StageWeights = dict[str, Tensor]


def soup_weights(method: nn.Module) -> StageWeights:
    """The entries of ``method.state_dict()`` that differ between stages: every parameter that
    trains and every floating-point buffer, copied to the CPU."""
    from raycl.methods.queues import queue_buffer_names

    trained = {name for name, param in method.named_parameters() if param.requires_grad}
    # Queues of past samples are training state, not part of the model a soup averages.
    queues = set(queue_buffer_names(method))
    buffers = {name for name, buffer in method.named_buffers()
               if buffer.is_floating_point() and name not in queues}
    return {name: value.detach().cpu().clone() for name, value in method.state_dict().items()
            if name in trained or name in buffers}


def encoder_weights(method: Method) -> StageWeights:
    """The state of ``method.backbone`` (its own keys, every buffer included), copied to the
    CPU: all that the stage's embedding needs (``embed`` reads the backbone alone; CLIP's pixel
    statistics are constants), none of the projector's or queues'."""
    return {name: value.detach().cpu().clone()
            for name, value in method.backbone.state_dict().items()}


def kept_weights(config: CoreConfig, method: Method) -> StageWeights | None:
    """What a finished stage of an MCL trial keeps for the trial's representation.

    Args:
        config: the trial's config (``mcl.integration``).
        method: the stage's trained method.

    Returns:
        ``soup``: its share of the model soup (:func:`soup_weights`); ``concat``: its encoder
        (:func:`encoder_weights`), which evaluation does not need (it keeps the stage's
        features) but an export of the whole concatenation does; None for a single stage.
    """
    if config.num_stages == 1:
        return None
    if config.mcl.integration == "soup":
        return soup_weights(method)
    return encoder_weights(method)


def average_weights(
    stages: list[StageWeights], device: torch.device | str = "cpu"
) -> StageWeights:
    """The model soup: the element-wise mean of each entry over the stages, on ``device``.

    Every entry is moved to ``device`` first: a stage restored from a checkpoint and one just
    trained need not hold their weights on the same device.

    Raises:
        ValueError: if the stages hold different entries or shapes (their architectures differ).
    """
    if not stages:
        raise ValueError("a soup needs at least one stage")
    keys = set(stages[0])
    for j, stage in enumerate(stages[1:], start=1):
        if set(stage) != keys:
            raise ValueError(f"stage {j} holds other weights than stage 0: "
                             f"{sorted(set(stage) ^ keys)[:3]}")
    soup = {}
    for key in stages[0]:
        values = [stage[key].to(device) for stage in stages]
        if any(value.shape != values[0].shape for value in values):
            raise ValueError(f"{key}: shapes differ between stages")
        soup[key] = torch.stack([value.double() for value in values]).mean(0).to(values[0].dtype)
    return soup


@dataclass(frozen=True)
class FeatureRef:
    """Where a finished stage's features were written once, for checkpoints to refer to.

    Attributes:
        stage: the stage whose features these are.
        file: the ``.npz`` (one array per split), relative to the directory that holds the
            run's checkpoints (``stage_features/stage_<j>_<sha256[:16]>.npz``).
        sha256: the file's SHA-256, checked when it is read back.
        splits: the splits it holds.
    """

    stage: int
    file: str
    sha256: str
    splits: tuple[str, ...]


@dataclass
class StageInputs:
    """What a stage needs from the stages before it (empty for stage 0 and single-stage methods).

    Attributes:
        stage: index j of the stage being trained.
        pseudo_labels: MCL group code of every training sample (None: no feature-aware negatives).
        features: frozen features of stages 0..j-1, per split (for integrated evaluation);
            rank 0 only (every other rank holds an empty dict per stage).
        assignments: k-means assignments of stages 0..j-1 (kept in checkpoints for resumption).
        stage_metrics: final metrics of stages 0..j-1 (for the per-stage diagnostics).
        weights: kept weights of stages 0..j-1 (:func:`kept_weights`: soup shares, or the
            concat's encoders); fewer than j in a trial resumed from a checkpoint of raycl
            before concat kept them (its export is then refused).
        feature_refs: per earlier stage, where its ``features`` were written once (a
            checkpoint then refers to them instead of holding them); stages absent here are
            stored inline.
    """

    stage: int = 0
    pseudo_labels: np.ndarray | None = None
    features: list[Features] = field(default_factory=list)
    assignments: list[np.ndarray] = field(default_factory=list)
    stage_metrics: list[dict[str, Any]] = field(default_factory=list)
    weights: list[StageWeights] = field(default_factory=list)
    feature_refs: dict[int, FeatureRef] = field(default_factory=dict)

    def integrated(
        self, current: Features, rows: Mapping[str, np.ndarray | None] | None = None
    ) -> Features:
        """The integration of the earlier stages with ``current``, for each split it holds.

        ``rows``: the rows of a split ``current`` holds when it is a subset (the probe's capped
        training rows): an earlier stage that kept the whole split (its training features, for
        the clustering) is cut to them. Only rank 0 holds features: elsewhere ``current`` and
        the earlier stages' are empty, and so is the result.
        """
        rows = rows or {}

        def earlier(stage: Features, split: str, count: int) -> np.ndarray:
            values, picked = stage[split], rows.get(split)
            return values[picked] if picked is not None and len(values) != count else values

        return {split: integrate([*(earlier(f, split, len(values)) for f in self.features),
                                  values])
                for split, values in current.items()}

    def save(self, path: Path) -> None:
        """Into ``path`` (``.npz``; kept weights beside it): every field, the features of a
        stage in :attr:`feature_refs` as that reference (``feature_refs``, JSON), the others'
        inline (``features_<j>_<split>``, the format before references)."""
        arrays: dict[str, np.ndarray] = {
            "stage": np.asarray(self.stage),
            "stage_metrics": np.asarray(json.dumps(self.stage_metrics)),
        }
        if self.pseudo_labels is not None:
            arrays["pseudo_labels"] = self.pseudo_labels
        for j, features in enumerate(self.features):
            if j in self.feature_refs:
                continue
            for split, values in features.items():
                arrays[f"features_{j}_{split}"] = values
        for j, assignment in enumerate(self.assignments):
            arrays[f"assignments_{j}"] = assignment
        if self.feature_refs:
            refs = [{**vars(ref), "splits": list(ref.splits)}
                    for _, ref in sorted(self.feature_refs.items())]
            arrays["feature_refs"] = np.asarray(json.dumps(refs))
        np.savez(path, **arrays)
        if self.weights:
            torch.save(self.weights, path.with_name(STAGE_WEIGHTS_FILE))

    @classmethod
    def load(
        cls, path: Path | IO[bytes], weights: list[StageWeights] | None = None,
        features: bool = True,
    ) -> StageInputs:
        """What :meth:`save` wrote to ``path`` (a local file, or one opened for random access:
        only the members read are fetched). ``weights``: the kept weights, read by the caller
        (by default: the file beside a local ``path``). ``features``: False reads no inline
        features (every stage's entry empty, as on a rank other than 0). A referenced stage's
        entry is empty: the caller reads the file of its :attr:`feature_refs`."""
        if weights is None:
            weights_path = (path.with_name(STAGE_WEIGHTS_FILE) if isinstance(path, Path)
                            else None)
            weights = (torch.load(weights_path, map_location="cpu", weights_only=True)
                       if weights_path is not None and weights_path.exists() else [])
        with np.load(path) as arrays:
            stage = int(arrays["stage"])
            stage_features: list[Features] = [{} for _ in range(stage)]
            for name in arrays.files if features else ():
                if name.startswith("features_"):
                    _, j, split = name.split("_", 2)
                    stage_features[int(j)][split] = arrays[name]
            refs = (json.loads(str(arrays["feature_refs"])) if "feature_refs" in arrays.files
                    else [])
            return cls(
                stage=stage,
                pseudo_labels=arrays["pseudo_labels"] if "pseudo_labels" in arrays.files
                else None,
                features=stage_features,
                assignments=[arrays[f"assignments_{j}"] for j in range(stage)
                             if f"assignments_{j}" in arrays.files],
                stage_metrics=json.loads(str(arrays["stage_metrics"])),
                weights=weights,
                feature_refs={ref["stage"]: FeatureRef(**{**ref, "splits": tuple(ref["splits"])})
                              for ref in refs},
            )


def cluster_stage(
    config: CoreConfig, inputs: StageInputs, features: Features,
    device: torch.device | None = None,
) -> np.ndarray:
    """k-means of stage j's training features into ``mcl.clusters`` groups (seeded by the stage).
    Fits on every training point unless ``mcl.kmeans_max_points`` caps it. ``device``: the
    calling worker's device; faiss runs on that GPU when it is one (see :func:`kmeans_gpu`),
    else on the CPU."""
    return kmeans(features["train"], config.mcl.clusters, seed=config.seed + inputs.stage,
                  niter=config.mcl.kmeans_iterations, max_points=config.mcl.kmeans_max_points,
                  gpu=kmeans_gpu(device))


def checkpointed_features(config: CoreConfig, stage: int, features: Features) -> Features | None:
    """What of a finished stage's ``features`` its last checkpoint keeps: only what a trial
    resumed there reads (at ImageNet scale every split's features are ~11 GB per checkpoint).

    None after the last stage (a single stage's included): the trial process reads the final
    checkpoint's diagnostics alone. Before another stage: ``train``, which the resumed trial
    clusters for the next one, and, for ``concat``, every split, the frozen features the later
    stages integrate; a ``soup`` integrates the stages' weights, not their features.
    """
    if stage >= config.num_stages - 1:
        return None
    if config.mcl.integration == "soup":
        return {"train": features["train"]}
    return features


def next_stage_inputs(
    config: CoreConfig,
    inputs: StageInputs,
    features: Features,
    metrics: dict[str, Any] | None = None,
    assignment: np.ndarray | None = None,
    weights: StageWeights | None = None,
) -> StageInputs:
    """Stage j+1's inputs: stage j's clustering (``assignment``, computed here when None) added to
    the pseudo labels, which encode every stage so far, its features frozen and its ``weights``
    (:func:`kept_weights`) kept."""
    if assignment is None:
        assignment = cluster_stage(config, inputs, features)
    assignments = [*inputs.assignments, assignment]
    return StageInputs(
        stage=inputs.stage + 1,
        pseudo_labels=pseudo_label_codes(assignments, config.mcl.clusters),
        # A soup integrates weights: the features only a fallback to concat reads are not kept.
        features=[*inputs.features, features if _integrates_features(config, weights) else {}],
        assignments=assignments,
        stage_metrics=[*inputs.stage_metrics, metrics or {}],
        weights=[*inputs.weights, weights] if weights is not None else inputs.weights,
        # The earlier stages' features already in the run's storage are not written again.
        feature_refs=dict(inputs.feature_refs),
    )


def _integrates_features(config: CoreConfig, weights: StageWeights | None) -> bool:
    """Whether the later stages integrate a finished stage's features: ``concat``, or a soup
    stage that kept no weights (a checkpoint of older raycl), which
    :func:`~raycl.worker.embed.integrate_stages` integrates as ``concat``."""
    return weights is None or config.mcl.integration != "soup"


def mcl_summary(
    config: CoreConfig,
    inputs: StageInputs,
    features: Features,
    metrics: dict[str, Any],
    device: torch.device | None = None,
) -> dict[str, np.ndarray]:
    """MCL's end-of-trial summary, made on rank 0 after the last stage's last evaluation, for
    the trial process to draw and log (:mod:`raycl.eval.figures`): small arrays, never features.

    The last stage's training features are clustered as between stages (it feeds nothing but
    this), then: :data:`MCL_AMI`, the (S, S) AMI between the stages' clusterings;
    :data:`MCL_GROUP_SIZES`, the sizes of the last stage's pseudo-label groups, largest first;
    :data:`MCL_STAGE_METRICS`, per stage its final test-split linear-probe scores (JSON).

    Args:
        inputs: the last stage's inputs (the earlier stages' clusterings and metrics).
        features: the last stage's features per split (``train`` is clustered).
        metrics: the last stage's final metrics.
        device: the worker's device (k-means runs on it when it is a GPU faiss can use).

    Returns:
        The arrays, or none when the clustering failed (extras: logged, the trial goes on).
    """
    try:
        assignments = [*inputs.assignments, cluster_stage(config, inputs, features, device)]
    except CollectiveInSingleRankSection:
        raise
    except Exception:  # extras: a failure here must not cost the trial its results
        logger.exception("MCL's end-of-trial clustering failed; the trial's results are kept")
        return {}
    codes = pseudo_label_codes(inputs.assignments, config.mcl.clusters)
    scores = [{key: value for key, value in stage.items() if _is_test_probe(key)}
              for stage in [*inputs.stage_metrics, metrics]]
    return {MCL_AMI: ami_matrix(assignments), MCL_GROUP_SIZES: group_size_histogram(codes),
            MCL_STAGE_METRICS: np.asarray(json.dumps(scores))}


def _is_test_probe(key: str) -> bool:
    """Whether ``key`` is a full-label linear probe's test score (of a stage or the trial)."""
    name = maybe_metric(key)
    return name is not None and (name.split, name.family, name.percent) == (TEST, LINEAR, None)


def integrate(features: list[np.ndarray]) -> np.ndarray:
    """MCL cross-stage integration: concatenate L2-normalised stage features, normalise again.

    Normalising each stage first keeps one stage from dominating by scale; the authors'
    code L2-normalises the concatenation again before evaluation.
    """
    if len(features) == 1:
        return features[0]
    return l2_normalize(np.concatenate([l2_normalize(f) for f in features], axis=1))
