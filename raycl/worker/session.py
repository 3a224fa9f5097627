"""How the worker loop talks to its runtime: rank, device, reports, the checkpoint to resume,
and how a model is wrapped for data parallelism.

:class:`RayTrainSession` is a Ray Train worker (``scaling.num_workers >= 1``);
:class:`InProcessSession` runs the same loop inside the trial process (``num_workers: 0``), or
in a process of a group set up by hand (``torch.distributed.init_process_group``, e.g. the
two-worker tests), whose rank and world size it takes.
"""

from __future__ import annotations

import shutil
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raycl import distributed
from raycl.worker.storage import persist_checkpoint


class RayTrainSession:
    """The loop's view of Ray Train: rank, device, reports and the checkpoint to resume from."""

    def __init__(self) -> None:
        context = ray.train.get_context()
        self.rank = context.get_world_rank()
        self.world_size = context.get_world_size()
        self.device = ray.train.torch.get_device()

    def latest_checkpoint(self) -> ray.train.Checkpoint | None:
        return ray.train.get_checkpoint()

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """DDP as Ray Train sets it up (device placement, ``device_ids``)."""
        return ray.train.torch.prepare_model(model)

    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
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
        from ray.tune.trainable.trainable_fn_utils import _in_tune_session

        # 0 and 1 unless this process joined a process group (no group inside a Tune trial).
        self.rank, self.world_size = distributed.rank(), distributed.world_size()
        self.device = device
        self.resume_from = resume_from
        self.in_tune = _in_tune_session()
        self.last_checkpoint_dir: str | None = None
        self.last_report: dict[str, Any] = {}

    def latest_checkpoint(self) -> ray.train.Checkpoint | None:
        return self.resume_from

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Plain DDP over the process group this process joined (as Ray Train's, which needs
        a Ray Train worker); the model itself in a single process."""
        if self.world_size == 1:
            return model
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
