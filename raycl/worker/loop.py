"""The Ray Train worker loop, shared by every method: one worker group per trial.

``train_loop_per_worker`` runs a whole trial: it loads the data once, resumes from the newest
readable checkpoint when there is one (:mod:`raycl.worker.checkpoints`), and trains every stage
(one for most methods, N for MCL; :mod:`raycl.worker.stage`), each epoch reporting ``train/*``
metrics, evaluations (:mod:`raycl.worker.evaluate`), ``perf/*`` figures and a checkpoint.
Between MCL stages the workers embed their shards (gathered on rank 0 alone), rank 0 clusters
and broadcasts the assignment (:mod:`raycl.worker.stage_integration`), and training goes on
with a fresh encoder in the same processes.

A loss that turns NaN/inf ends the trial (:mod:`raycl.worker.epoch`) with a report naming the
step and value (``raycl/failed``), which MLflow records as FAILED.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raycl.config.schema import CoreConfig
from raycl.data import DatasetSplits, load_dataset
from raycl.distributed import broadcast_from_rank0, single_rank_section
from raycl.eval.multimodal import EvalSets, load_mmvp_sets
from raycl.eval.transfer import load_transfer_sets
from raycl.methods import method_class
from raycl.worker.checkpoints import CheckpointError, Restored, restore
from raycl.worker.context import TrialContext
from raycl.worker.cuda import configure_cuda_backends
from raycl.worker.data_barrier import data_barrier
from raycl.worker.device_hours import DEVICE_HOURS
from raycl.worker.loader import trial_training_images
from raycl.worker.outcome import FAIL_REASON_KEY, FAILED_KEY, NonFiniteLossError
from raycl.worker.perf import Clock
from raycl.worker.session import RayTrainSession, Session
from raycl.worker.stage import train_stage
from raycl.worker.stage_integration import (
    FEATURES_FILE,
    Features,
    StageInputs,
    StageWeights,
    cluster_stage,
    next_stage_inputs,
)

logger = logging.getLogger(__name__)


def train_loop_per_worker(context: TrialContext) -> None:
    """Ray Train entry point: every stage of one trial on this worker (see
    :func:`run_trial_loop`)."""
    run_trial_loop(context, RayTrainSession())


def run_trial_loop(context: TrialContext, session: Session) -> None:
    """Train every stage of ``context``'s trial: one worker group for the whole trial.

    The data is loaded once; between MCL stages the workers embed their shards and gather them
    on rank 0, which clusters and broadcasts the assignment, and every rank goes on with a
    fresh encoder. A restart resumes from the newest readable checkpoint: inside the stage it
    was written in, or after it when that stage had finished.
    """
    config = context.config
    torch.set_num_threads(max(1, int(config.scaling.cpus_per_worker)))
    configure_cuda_backends(session.device)  # TF32, cuDNN autotuning; nothing on CPU
    with data_barrier():  # a node's cache build waits outside NCCL's 30-minute timeout
        data, eval_sets = _load_data(config)
    if session.rank == 0 and data.skipped:
        with single_rank_section("rank 0's list of skipped images"):
            log_skipped_images(config, context.trial_id, data.skipped)
    # Once per trial: on the device (data.on_device) every stage gathers its batches there.
    train_images = trial_training_images(config, data, session.device)
    clock = Clock(context.started_at)
    last_stage = config.num_stages - 1

    restored = restore(session)
    inputs, resume = StageInputs(), None
    if restored is not None:
        clock.device_hours_before = float(restored.metrics.get(DEVICE_HOURS, 0.0))
        progress = restored.progress
        logger.info("resuming trial at stage %s epoch %s", progress["stage"], progress["epoch"])
        if progress["stage_complete"] and progress["stage"] == last_stage:
            report_finished(restored, session)  # the trial had finished: nothing to train
            return
        inputs, resume = _resume_point(config, restored, session, clock)
    try:
        while True:
            result = train_stage(context, data, train_images, eval_sets, inputs, session,
                                 resume, clock)
            resume = None
            if inputs.stage == last_stage:
                return
            inputs = between_stages(config, inputs, result.features, result.metrics,
                                    result.weights, session, clock)
    except NonFiniteLossError as exc:
        # Every rank raised at the same check (the flag is all-reduced), so every rank reports.
        logger.error("%s", exc)
        report = {FAILED_KEY: 1.0, FAIL_REASON_KEY: str(exc)} if session.rank == 0 else {}
        session.report(report, None)


def _load_data(config: CoreConfig) -> tuple[DatasetSplits, EvalSets]:
    """The trial's data, loaded once, and its extra evaluation sets (transfer, MMVP pairs)."""
    data = load_dataset(config.data, config.data_seed)
    if config.train.batch_size > len(data.train.images):
        raise ValueError(f"train.batch_size={config.train.batch_size} exceeds the training split "
                         f"({len(data.train.images)} samples)")
    # MMVP-style pairs score image-text methods only (a unimodal one has no statements to match).
    eval_sets = EvalSets(
        transfer=load_transfer_sets(config, data.channels),
        mmvp=load_mmvp_sets(config) if method_class(config).multimodal else {})
    return data, eval_sets


def log_skipped_images(config: CoreConfig, trial_id: str, skipped: list[tuple[str, str]]) -> None:
    """The unreadable image files ``data.skip_unreadable`` left out of every split, one per line
    with why, as the trial run's artifact ``diagnostics/skipped_images.txt`` (their count is
    ``data/skipped``, every epoch)."""
    from raycl.tracking.relay import log_to_trial_run

    logger.info("data: %d unreadable image file(s) left out of every split "
                "(data.skip_unreadable), first %s", len(skipped), skipped[0][0])
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "skipped_images.txt"
        path.write_text("".join(f"{name}\t{why}\n" for name, why in skipped))
        log_to_trial_run(config, trial_id, {}, Path(directory))


def _resume_point(
    config: CoreConfig, restored: Restored, session: Session, clock: Clock
) -> tuple[StageInputs, Restored | None]:
    """Where an unfinished trial goes on: inside the checkpointed stage (its inputs, and the
    checkpoint to resume), or, when that stage had finished, at the next one (clustered here)."""
    if not restored.progress["stage_complete"]:
        if session.rank != 0:  # only rank 0 integrates the earlier stages' features
            restored.inputs.features = [{} for _ in restored.inputs.features]
        return restored.inputs, restored
    if restored.features is None:  # written by a raycl that keeps them before another stage
        raise CheckpointError(f"the checkpoint of finished stage {restored.progress['stage']} "
                              f"holds no {FEATURES_FILE}: stage "
                              f"{restored.progress['stage'] + 1} clusters its training features")
    soup = restored.state.pop("soup", None)  # the stage's kept weights (soup share or encoder)
    restored.state.clear()  # the finished stage's model and optimizer: not needed, not kept
    inputs = between_stages(config, restored.inputs, restored.features, restored.metrics,
                            soup, session, clock)
    shutil.rmtree(restored.directory, ignore_errors=True)
    return inputs, None


def between_stages(
    config: CoreConfig,
    inputs: StageInputs,
    features: Features,
    metrics: dict[str, Any],
    weights: StageWeights | None,
    session: Session,
    clock: Clock,
) -> StageInputs:
    """Rank 0 clusters stage j's training features; every rank gets the same assignment.
    ``weights``: the stage's kept weights (its soup share, or the concat's encoder), else None.

    Only rank 0 keeps the stage's features (it integrates, scores and checkpoints them): every
    other rank's next inputs carry the pseudo labels and assignments, no features."""
    started = time.perf_counter()
    if session.rank == 0:
        with single_rank_section("rank 0's clustering between stages"):
            assignment = cluster_stage(config, inputs, features, session.device).astype(np.int64)
    else:
        features, assignment = {}, np.zeros(0, dtype=np.int64)
    # The other ranks learn the assignment's length from rank 0: they hold no features.
    count = broadcast_from_rank0(torch.tensor([len(assignment)], dtype=torch.int64,
                                               device=session.device))
    if session.rank != 0:
        assignment = np.zeros(int(count.item()), dtype=np.int64)
    assignment = broadcast_from_rank0(torch.from_numpy(assignment).to(session.device))
    clock.record("perf/kmeans_seconds", time.perf_counter() - started)
    return next_stage_inputs(config, inputs, features, metrics, assignment.cpu().numpy(),
                             weights)


def report_finished(restored: Restored, session: Session) -> None:
    """A trial restarted after its last checkpoint: hand that checkpoint back (the trial process
    reads its diagnostics) with the evaluation it carried, on rank 0."""
    metrics = {key: value for key, value in restored.metrics.items() if "train/" not in key}
    if session.rank == 0:
        session.report(metrics, str(restored.directory))
    else:
        shutil.rmtree(restored.directory, ignore_errors=True)
        session.report({}, None)


__all__ = ["between_stages", "report_finished", "run_trial_loop", "train_loop_per_worker"]
