"""How the worker loop talks to its runtime: rank, device, reports, the checkpoint to resume,
and how a model is wrapped for data parallelism.

:class:`RayTrainSession` is a Ray Train worker (``scaling.num_workers >= 1``);
:class:`InProcessSession` runs the same loop inside the trial process (``num_workers: 0``), or
in a process of a group set up by hand (``torch.distributed.init_process_group``, e.g. the
two-worker tests), whose rank and world size it takes.

Ray is imported only where a Ray Train or Tune session is used: the in-process session runs
the loop on a machine without Ray (``benchmarks/fidelity.py`` on a bare GPU machine).
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raycl import distributed
from raycl.models.sync_batchnorm import convert_batchnorm
from raycl.worker.storage import StoredDirectory, persist_checkpoint

if TYPE_CHECKING:
    import ray.train


def sync_batchnorm(model: nn.Module, device: torch.device, world_size: int) -> nn.Module:
    """``model`` with every BatchNorm layer computing its statistics over the global batch, as
    SimCLR's global BN and BYOL do across accelerators (``model.sync_batchnorm``), when
    ``world_size`` > 1 on any backend: torch's fused ``nn.SyncBatchNorm`` on CUDA (NCCL),
    :class:`raycl.models.sync_batchnorm.GlobalBatchNorm` elsewhere (gloo, which torch's refuses;
    :mod:`raycl.models.sync_batchnorm` says why both). One rank has nothing to share: left alone.

    The layers are replaced in place (``model`` is returned for convenience), momentum copies
    included: the method the stage evaluates and checkpoints is the one DDP trains. The new
    layers keep the old ones' parameter and buffer objects, so the optimizer built before and
    the checkpoint's keys are unchanged. Each training forward of a converted layer is a
    collective: every rank runs it (evaluation runs in eval mode, which enters none).
    """
    if world_size > 1:
        convert_batchnorm(model, fused_cuda=device.type == "cuda")
    return model


class RayTrainSession:
    """The loop's view of Ray Train: rank, device, reports and the checkpoint to resume from."""

    def __init__(self) -> None:
        import ray.train
        import ray.train.torch

        context = ray.train.get_context()
        self.rank = context.get_world_rank()
        self.world_size = context.get_world_size()
        self.device = ray.train.torch.get_device()

    def latest_checkpoint(self) -> ray.train.Checkpoint | None:
        import ray.train

        return ray.train.get_checkpoint()

    def run_storage(self) -> StoredDirectory | None:
        """The directory of the run's storage its checkpoints are persisted into (the run's
        experiment directory: Ray Train 2.60 names each ``<it>/checkpoint_<timestamp>``)."""
        import ray.train

        storage = ray.train.get_context().get_storage()
        return StoredDirectory(storage.storage_filesystem, storage.experiment_fs_path)

    def wrap_model(self, model: nn.Module, sync_bn: bool = False) -> nn.Module:
        """DDP as Ray Train sets it up (device placement, ``device_ids``); BatchNorm over the
        global batch first when ``sync_bn`` (:func:`sync_batchnorm`)."""
        if sync_bn:
            sync_batchnorm(model, self.device, self.world_size)
        import ray.train.torch

        return ray.train.torch.prepare_model(model)

    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        import ray.train

        checkpoint = (ray.train.Checkpoint.from_directory(checkpoint_dir)
                      if checkpoint_dir else None)
        # Ray's upload, waiting out a storage outage rather than failing the worker group.
        ray.train.report(metrics, checkpoint=checkpoint,
                         checkpoint_upload_fn=persist_checkpoint if checkpoint else None)
        if checkpoint_dir:  # uploaded to the run's storage by now (synchronous upload)
            shutil.rmtree(checkpoint_dir, ignore_errors=True)


class InProcessSession:
    """``scaling.num_workers: 0``: the loop runs in the calling (trial) process, no TorchTrainer.

    Ray Train V2's own local mode (``ScalingConfig(num_workers=0)``) refuses every
    ``ray.train.*`` call inside a Tune trial (ray-project/ray#49454) and runs no callbacks, so
    this session reports straight to Tune instead, which also persists each checkpoint to the
    trial's storage; a restarted trial resumes from ``tune.get_checkpoint()``.
    """

    def __init__(
        self, device: torch.device, resume_from: ray.train.Checkpoint | None = None
    ) -> None:
        # 0 and 1 unless this process joined a process group (no group inside a Tune trial).
        self.rank, self.world_size = distributed.rank(), distributed.world_size()
        self.device = device
        self.resume_from = resume_from
        self.in_tune = _in_tune_session()  # False without Ray
        self.last_checkpoint_dir: str | None = None
        self.last_report: dict[str, Any] = {}

    def latest_checkpoint(self) -> ray.train.Checkpoint | None:
        return self.resume_from

    def run_storage(self) -> StoredDirectory | None:
        """Inside Tune, the trial's directory of the run's storage, which holds its checkpoints
        (``<it>/checkpoint_000007``); None elsewhere (nothing keeps a checkpoint)."""
        if not self.in_tune:
            return None
        from ray import tune

        storage = tune.get_context().get_storage()
        return StoredDirectory(storage.storage_filesystem, storage.trial_fs_path)

    def wrap_model(self, model: nn.Module, sync_bn: bool = False) -> nn.Module:
        """Plain DDP over the process group this process joined (as Ray Train's, which needs
        a Ray Train worker), BatchNorm over the global batch first when ``sync_bn``
        (:func:`sync_batchnorm`); the model itself in a single process."""
        if self.world_size == 1:
            return model
        if sync_bn:
            sync_batchnorm(model, self.device, self.world_size)
        device_ids = [self.device] if self.device.type == "cuda" else None
        return DistributedDataParallel(model.to(self.device), device_ids=device_ids)

    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        self.last_report = metrics
        if checkpoint_dir:
            # Tune copies each checkpoint into the trial's storage; keep only the newest here,
            # which the pipeline reads (and removes) when the trial ends.
            if self.last_checkpoint_dir:
                shutil.rmtree(self.last_checkpoint_dir, ignore_errors=True)
            self.last_checkpoint_dir = checkpoint_dir
        if self.in_tune:
            from ray import tune

            checkpoint = tune.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
            tune.report(metrics, checkpoint=checkpoint)


Session = RayTrainSession | InProcessSession


def _in_tune_session() -> bool:
    """Whether this process runs a Tune trial; False where Ray is not installed."""
    try:
        from ray.tune.trainable.trainable_fn_utils import _in_tune_session as in_session
    except ImportError:
        return False
    return in_session()
