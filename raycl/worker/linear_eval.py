"""The papers' linear evaluation at a trial's end (``eval.linear_sgd``), on the trial's workers.

:func:`linear_sgd_evaluation` runs after the last stage's last evaluation, on every rank, before
that epoch's checkpoint and report: its metrics (``val/linear_sgd/...``, ``test/linear_sgd/...``,
``diag/linear_sgd_lr/...``, ``perf/linear_sgd_seconds``) join the trial's final report, so
Tune and MLflow record them with the closed-form probe's, and the checkpoint carries them (a
trial resumed after it finished reports them again: :func:`raycl.worker.loop.report_finished`).
The protocol itself is :func:`raycl.eval.linear_sgd.evaluate_linear_sgd` (no Ray).

It reads every row of its splits: the closed-form probe's caps (``eval.max_train_samples``,
``eval.max_eval_samples``, which make the every-epoch probe cheap) do not apply, so what is
printed beside the paper's value is the papers' protocol on the whole training split (a probe
of 10 000 ImageNet images, ~10 per class, is not it). Memory mode only (stream mode and MCL's
several encoders are refused before launch, :func:`raycl.launch.checks.check_linear_sgd`).

It runs on the first :func:`probe_ranks` ranks only, in a process group of their own: the
protocol's batch of 256 split over 64 GPUs is 4 images a step and no faster than over 8. The
other ranks wait in a gloo barrier outside the default group, whose watchdog
(``scaling.collective_timeout_s``) would otherwise end the trial during the probe's hours.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from raycl.config.metric_names import PERF, metric_name
from raycl.config.schema import CoreConfig
from raycl.data import DatasetSplits, ImageSet
from raycl.data.stream.files import FileRows
from raycl.data.stream.shards import ShardRows
from raycl.distributed import barrier_after, rank, world_size
from raycl.eval.linear_sgd import (
    FrozenEncoder,
    LabelledImages,
    evaluate_linear_sgd,
    linear_sgd_metrics,
)
from raycl.methods.base import Method
from raycl.worker.optim import inference_autocast

if TYPE_CHECKING:
    from raycl.worker.session import Session

# The fewest images of each global batch a rank of the papers' probe takes (:func:`probe_ranks`).
PROBE_ROWS_PER_RANK = 32
# How long the ranks outside the probe wait for it (ImageNet's 100 epochs on 8 GPUs: hours).
PROBE_WAIT = timedelta(hours=24)


def _labelled(part: ImageSet) -> LabelledImages:
    """A split as the protocol reads it (its images stay a view: read a batch at a time)."""
    if isinstance(part.images, FileRows | ShardRows):
        raise ValueError("eval.linear_sgd: not yet for data.loader: stream (its images are "
                         "files decoded in batches); use data.loader: memory")
    return LabelledImages(part.images, part.labels)


def linear_sgd_evaluation(
    config: CoreConfig, data: DatasetSplits, method: Method, session: Session
) -> dict[str, float]:
    """``eval.linear_sgd`` of the trial's ``method`` on every rank of ``session`` (each takes its
    share of every batch; the result is the same on every rank).

    Args:
        config: the trial's config (``eval.linear_sgd``; None: nothing is run).
        data: the trial's splits (memory mode), every row: not the closed-form probe's
            capped rows.
        method: the trial's trained method; its ``embed`` is the frozen backbone.
        session: this worker's rank, world and device.

    Returns:
        The metrics (:func:`raycl.eval.linear_sgd.linear_sgd_metrics`) and
        ``perf/linear_sgd_seconds``; ``{}`` when ``eval.linear_sgd`` is off or the data has no
        labels.

    Raises:
        ValueError: a config the protocol does not cover yet (MCL's stages, stream mode).
    """
    settings = config.eval.linear_sgd
    if settings is None or not data.attributes:
        return {}
    if config.num_stages > 1:
        raise ValueError("eval.linear_sgd: not yet for MCL (its representation is several "
                         "stages' encoders)")
    started = time.perf_counter()
    encoder = FrozenEncoder(model=method, embed=method.embed,
                            autocast=inference_autocast(config, session.device))
    ranks = probe_ranks(settings.batch_size, world_size())
    metrics: dict[str, float] = {}
    with probe_group(ranks) as group:
        if group is not None:  # this rank is one of the probe's
            results = evaluate_linear_sgd(
                encoder, _labelled(data.train), _labelled(data.val),
                lambda: _labelled(data.test),
                {attribute: data.num_classes[attribute] for attribute in data.attributes},
                settings, session.device, config.seed, group.group)
            metrics.update(linear_sgd_metrics(results))
    metrics[metric_name(PERF, None, "linear_sgd_ranks")] = float(ranks)
    metrics[metric_name(PERF, None, "linear_sgd_seconds")] = time.perf_counter() - started
    return metrics


def probe_ranks(batch_size: int, world: int) -> int:
    """How many ranks share the papers' probe: each takes at least :data:`PROBE_ROWS_PER_RANK`
    images of every global batch (8 ranks for the papers' 256), at most the whole world. More
    ranks only cut each step's batch further (4 images per GPU at 64 workers), and the probe's
    ~450 k latency-bound steps, an all_reduce each, take as long as on 8.

    Example:
        >>> probe_ranks(256, 64), probe_ranks(256, 4), probe_ranks(16, 8)
        (8, 4, 1)
    """
    return max(1, min(world, batch_size // PROBE_ROWS_PER_RANK))


@contextmanager
def probe_group(ranks: int) -> Iterator[_ProbeGroup | None]:
    """Ranks ``0 .. ranks - 1`` as a process group of their own, for the body; None on the
    other ranks, which wait for them in a gloo barrier outside the default group's watchdog
    (:func:`raycl.distributed.barrier_after`). Every rank enters it. A world of one, or a
    probe of every rank, is the default group (``group.group`` None): nothing is created."""
    world = world_size()
    if ranks >= world:
        yield _ProbeGroup(None)
        return
    # Every rank creates the group (torch's rule), members or not.
    group = dist.new_group(ranks=list(range(ranks)))
    try:
        with barrier_after(PROBE_WAIT):
            yield _ProbeGroup(group) if rank() < ranks else None
    finally:
        dist.destroy_process_group(group)


@dataclass(frozen=True)
class _ProbeGroup:
    """The probe's process group (None: the default one)."""

    group: dist.ProcessGroup | None


__all__ = ["linear_sgd_evaluation"]
