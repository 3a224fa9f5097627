"""``perf/device_hours``: what a trial has cost so far, the cost objective of a multi-objective
sweep (``tune.objectives``, e.g. accuracy against device-hours).

Wall-clock seconds since the trial (or its resumption) started, times the devices it holds
(GPUs: ``scaling.num_workers x gpus_per_worker``; CPU workers count one device each, the
in-process worker of ``num_workers: 0`` one), over 3600; a resumed trial adds what its
checkpoint had reported, so the figure is cumulative. Time lost between a trial's last
checkpoint and its failure is not counted. Imports no Ray.
"""

from __future__ import annotations

from raycl.config.schema import ScalingSection

DEVICE_HOURS = "perf/device_hours"


def trial_devices(scaling: ScalingSection) -> float:
    """The devices a trial holds: its GPUs' share, or one per CPU worker (at least one)."""
    workers = max(1, scaling.num_workers)
    return workers * scaling.gpus_per_worker if scaling.use_gpu else float(workers)


def device_hours(seconds: float, devices: float, before: float = 0.0) -> float:
    """``before + seconds x devices / 3600``.

    Args:
        seconds: wall-clock seconds since the trial (or its resumption) started.
        devices: the devices it holds (:func:`trial_devices`).
        before: the device-hours its checkpoint reported (0 for a fresh trial).

    Raises:
        ValueError: a negative argument.
    """
    if seconds < 0 or devices < 0 or before < 0:
        raise ValueError(f"seconds={seconds}, devices={devices}, before={before}: expected "
                         f"values of at least 0")
    return before + seconds * devices / 3600.0


__all__ = ["DEVICE_HOURS", "device_hours", "trial_devices"]
