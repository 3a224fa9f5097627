"""A trial: one stage for most methods, N stages for MCL.

Each stage is a ``TorchTrainer(train_loop_per_worker, ScalingConfig).fit()``. Between MCL stages
the trial clusters the stage's features of the whole training set (faiss k-means) and extends every
sample's pseudo label, so the next stage's fresh encoder only contrasts samples that earlier stages
could not tell apart (feature-aware negatives).

Resumption: every checkpoint carries the frozen features and clusterings of the finished stages
(``stage_inputs.npz``). A restarted trial either resumes from Tune's checkpoint (in-process mode)
or re-creates each stage's trainer under the same run name, which Ray Train resumes from storage;
finished stages then return at once.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray import tune
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from raycl.cluster import ami_matrix, group_size_histogram, kmeans, pseudo_label_codes
from raycl.config import SearchConfig, apply_overrides
from raycl.constraints import trial_problem
from raycl.data import ATTRIBUTES, split_sizes_for
from raycl.session import InProcessSession
from raycl.stages import (
    FEATURES_FILE,
    METRICS_FILE,
    PROGRESS_FILE,
    STAGE_INPUTS_FILE,
    Features,
    StageInputs,
)
from raycl.train import run_stage, train_loop_per_worker

logger = logging.getLogger(__name__)

SKIPPED_KEY = "raycl/skipped"


def next_stage_inputs(
    config: SearchConfig,
    inputs: StageInputs,
    features: Features,
    metrics: dict[str, Any] | None = None,
) -> StageInputs:
    """Cluster stage j's training features and build stage j+1's inputs (pseudo labels over all
    stages). k-means fits on every training point unless ``mcl.kmeans_max_points`` caps it."""
    assignment = kmeans(features["train"], config.mcl.clusters, seed=config.seed + inputs.stage,
                        niter=config.mcl.kmeans_iterations,
                        max_points=config.mcl.kmeans_max_points)
    assignments = [*inputs.assignments, assignment]
    return StageInputs(
        stage=inputs.stage + 1,
        pseudo_labels=pseudo_label_codes(assignments, config.mcl.clusters),
        features=[*inputs.features, features],
        assignments=assignments,
        stage_metrics=[*inputs.stage_metrics, metrics or {}],
    )


def _trial_id() -> str:
    try:
        return tune.get_context().get_trial_id() or "local"
    except Exception:  # not inside Tune (a direct call from a test or a notebook)
        return "local"


def _in_tune() -> bool:
    from ray.tune.trainable.trainable_fn_utils import _in_tune_session

    return _in_tune_session()


def _device(config: SearchConfig) -> torch.device:
    if config.scaling.use_gpu:
        if not torch.cuda.is_available():
            raise RuntimeError("scaling.use_gpu is true but this process sees no CUDA device")
        return torch.device("cuda")
    return torch.device("cpu")


def _read_stage_output(directory: Path) -> tuple[Features, dict[str, Any]]:
    with np.load(directory / FEATURES_FILE) as arrays:
        features = {split: arrays[split] for split in arrays.files}
    metrics = json.loads((directory / METRICS_FILE).read_text())
    return features, metrics


def fit_stage(
    config: SearchConfig,
    inputs: StageInputs,
    storage_path: str,
    resume_from: str | None = None,
    fault: dict[str, Any] | None = None,
) -> tuple[Features, dict[str, Any]]:
    """Train one stage; return its features per split and final metrics (from its checkpoint).

    ``scaling.num_workers >= 1``: a ``TorchTrainer`` whose run name is stable per trial and
    stage, so a restarted trial's trainer resumes from Ray Train's storage. ``0``: the same loop
    in this process (see :class:`raycl.session.InProcessSession`).
    """
    loop_config = {"config": config.to_dict(), "inputs": inputs, "fault": fault}
    if config.scaling.num_workers == 0:
        session = InProcessSession(_device(config), resume_from)
        run_stage(loop_config, session)
        if session.last_checkpoint_dir is None:
            raise RuntimeError(f"stage {inputs.stage} finished without a checkpoint")
        output = _read_stage_output(Path(session.last_checkpoint_dir))
        shutil.rmtree(session.last_checkpoint_dir, ignore_errors=True)
        return output

    callbacks = []
    if _in_tune():
        from ray.tune.integration.ray_train import TuneReportCallback

        callbacks.append(TuneReportCallback())
    trainer = TorchTrainer(
        train_loop_per_worker,
        # Workers fetch the (possibly large) frozen features from the object store.
        train_loop_config={**loop_config, "inputs": ray.put(inputs)},
        scaling_config=ScalingConfig(
            num_workers=config.scaling.num_workers,
            use_gpu=config.scaling.use_gpu,
            resources_per_worker={
                "CPU": config.scaling.cpus_per_worker,
                **({"GPU": config.scaling.gpus_per_worker} if config.scaling.use_gpu else {}),
            },
        ),
        run_config=RunConfig(
            name=f"{config.name}-{_trial_id()}-stage{inputs.stage}",
            storage_path=storage_path,
            failure_config=FailureConfig(max_failures=config.scaling.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            callbacks=callbacks,
        ),
    )
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"stage {inputs.stage} finished without a checkpoint")
    with result.checkpoint.as_directory() as directory:
        return _read_stage_output(Path(directory))


def _resume_point(config: SearchConfig) -> tuple[StageInputs, str | None, dict | None]:
    """In-process mode: where Tune's last checkpoint left this trial."""
    checkpoint = tune.get_checkpoint() if _in_tune() else None
    if checkpoint is None:
        return StageInputs(), None, None
    directory = Path(checkpoint.to_directory(tempfile.mkdtemp(prefix="raycl-resume-")))
    progress = json.loads((directory / PROGRESS_FILE).read_text())
    inputs = StageInputs.load(directory / STAGE_INPUTS_FILE)
    logger.info("resuming trial at stage %s epoch %s", progress["stage"], progress["epoch"])
    if not progress["stage_complete"]:
        return inputs, str(directory), None
    features, metrics = _read_stage_output(directory)
    return inputs, None, {"features": features, "metrics": metrics}


def run_trial(
    params: dict[str, Any],
    base_config: dict[str, Any],
    storage_path: str,
    fault: dict[str, Any] | None = None,
) -> None:
    """The Tune trainable: apply the sampled ``params`` (dotted keys) and run every stage.

    ``fault`` is a test hook (see ``raycl.train._maybe_inject_fault``).
    """
    config = apply_overrides(SearchConfig.model_validate(base_config), params)
    # A safety net: the searcher only proposes feasible trials (raycl.constraints), but a trial
    # that still cannot train is pruned before any training. Optuna records a trial without the
    # metric as PRUNED.
    problem = trial_problem(config, split_sizes_for(config.data)["train"])
    if problem:
        reason = f"{problem[0]}: {problem[1]}"
        logger.warning("skipping trial: %s", reason)
        tune.report({SKIPPED_KEY: 1.0, "raycl/skip_reason": reason})
        return

    inputs, resume_from, finished = _resume_point(config)
    while True:
        if finished is None:
            features, metrics = fit_stage(config, inputs, storage_path, resume_from, fault)
        else:
            features, metrics = finished["features"], finished["metrics"]
        resume_from, finished = None, None
        if config.num_stages == 1:
            return
        # After the last stage the clustering only feeds the diagnostics (AMI between stages).
        inputs = next_stage_inputs(config, inputs, features, metrics)
        if inputs.stage >= config.num_stages:
            break
    log_mcl_diagnostics(config, inputs)


# ---------------------------------------------------------------------------------------------
# MCL diagnostics


def log_mcl_diagnostics(config: SearchConfig, final: StageInputs) -> None:
    """AMI between stage clusterings, pseudo-label group sizes, per-stage accuracy plot."""
    from raycl import tracking

    ami = ami_matrix(final.assignments)
    codes = pseudo_label_codes(final.assignments[:-1], config.mcl.clusters)
    sizes = group_size_histogram(codes)  # largest first
    metrics: dict[str, float] = {}
    for i in range(len(ami)):
        for j in range(i + 1, len(ami)):
            metrics[f"mcl/ami/stage{i}_stage{j}"] = float(ami[i, j])
    metrics["mcl/groups"] = float(len(sizes))
    metrics["mcl/group_size_min"] = float(sizes.min())
    metrics["mcl/group_size_max"] = float(sizes.max())

    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory)
        (out / "ami_matrix.json").write_text(json.dumps(ami.round(4).tolist()))
        np.savetxt(out / "group_sizes.txt", sizes, fmt="%d")
        attributes = list(ATTRIBUTES[config.data.dataset])
        _plot_diagnostics(out, ami, sizes, final.stage_metrics, attributes, config.num_stages)
        tracking.log_to_trial_run(config, _trial_id(), metrics, out)


def _plot_diagnostics(
    out: Path,
    ami: np.ndarray,
    sizes: np.ndarray,
    stage_metrics: list[dict[str, Any]],
    attributes: list[str],
    stages: int,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].bar(range(len(sizes)), sizes)
    axes[0].set(title="pseudo-label group sizes (last stage)", xlabel="group (sorted)",
                ylabel="samples")
    image = axes[1].imshow(ami, vmin=0, vmax=1, cmap="viridis")
    axes[1].set(title="AMI between stage clusterings", xlabel="stage", ylabel="stage")
    figure.colorbar(image, ax=axes[1])
    width = 0.8 / (len(attributes) + 1)
    positions = np.arange(stages + 1)
    for a, attribute in enumerate([*attributes, "mean"]):
        values = [stage_metrics[j].get(f"stage{j}/test/linear/{attribute}", math.nan)
                  for j in range(stages)]
        values.append(stage_metrics[-1].get(f"test/linear/{attribute}", math.nan))
        axes[2].bar(positions + a * width, values, width, label=attribute)
    axes[2].set_xticks(positions + 0.4 - width / 2,
                       [f"stage {j}" for j in range(stages)] + ["integrated"])
    axes[2].set(title="linear probe accuracy (test split)", ylim=(0, 1.05))
    axes[2].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out / "mcl_diagnostics.png", dpi=100)
    plt.close(figure)
