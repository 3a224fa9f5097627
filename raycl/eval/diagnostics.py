"""End-of-trial diagnostics of a representation: its spectrum and its principal angles.

The HSCL paper argues from two pictures: how many singular values of the embedding stay alive
(Spectral CL lets most of them vanish, HSCL and SimCLR keep more: Figures 1(b), 3, 9), and how
many directions beyond the class centres are shared between classes (principal angles near 0
degrees) or private to one class (near 90 degrees; section 2.2). Both are computed on the test
split's features once per trial and logged as ``diag/*`` metrics, with plots as artifacts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from raycl.config.metric_names import DIAG, metric_name
from raycl.eval.spectrum import effective_rank, singular_values
from raycl.eval.subspaces import (
    AngleSummary,
    class_principal_angles,
    plot_angle_histogram,
    summarize_angles,
)

# Arrays of diagnostics.npz, which the trial process turns into plots.
SPECTRUM = "singular_values"
PROJECTION_SPECTRUM = "projection_singular_values"
ANGLES = "principal_angles"


def representation_diagnostics(
    features: np.ndarray,
    labels: np.ndarray,
    projections: np.ndarray | None = None,
    device: torch.device | str | None = None,
) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Effective rank and principal-angle counts of one representation.

    Args:
        features: (N, D) features the probes see (the backbone's, or MCL's integration).
        labels: (N,) class labels (the dataset's first attribute).
        projections: optional (N, m) projector outputs, the embedding the loss shapes.
        device: where the principal angles' float64 linear algebra runs (the trial's GPU
            when it has one); None for the CPU.

    Returns:
        ``(metrics, arrays)``: ``diag/effective_rank``, ``diag/projection_effective_rank``,
        ``diag/shared_directions``, ``diag/subclass_directions`` (mean per class, over at most
        :data:`~raycl.eval.subspaces.MAX_CLASSES` classes), and the
        singular values and angles for :func:`plot_diagnostics`.
    """
    metrics = {metric_name(DIAG, None, "effective_rank"): effective_rank(features)}
    arrays = {SPECTRUM: singular_values(features)}
    if projections is not None:
        metrics[metric_name(DIAG, None, "projection_effective_rank")] = effective_rank(
            projections)
        arrays[PROJECTION_SPECTRUM] = singular_values(projections)
    summary = summarize_angles(class_principal_angles(features, labels, device=device))
    if summary.classes:
        metrics[metric_name(DIAG, None, "shared_directions")] = summary.shared
        metrics[metric_name(DIAG, None, "subclass_directions")] = summary.subclass
    arrays[ANGLES] = summary.angles
    return metrics, arrays


def plot_diagnostics(arrays: dict[str, np.ndarray], out: Path, title: str) -> list[Path]:
    """The spectrum (log scale, normalised by the largest value) and the angle histogram.

    Args:
        arrays: as returned by :func:`representation_diagnostics` (or read from its npz).
        out: directory the PNGs are written to.
        title: run name shown in the plot titles.

    Returns:
        The files written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    figure, axis = plt.subplots(figsize=(6, 4))
    for key, label in ((SPECTRUM, "features"), (PROJECTION_SPECTRUM, "projections")):
        if key in arrays and arrays[key].size and arrays[key][0] > 0:
            values = arrays[key] / arrays[key][0]
            axis.semilogy(np.arange(1, values.size + 1), np.maximum(values, 1e-12), label=label)
    axis.set(title=f"singular value spectrum (test split) — {title}", xlabel="index",
             ylabel="σ_i / σ_1", ylim=(1e-6, 1.5))
    axis.legend()
    figure.tight_layout()
    path = out / "spectrum.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    written.append(path)
    if ANGLES in arrays and arrays[ANGLES].size:
        path = out / "principal_angles.png"
        plot_angle_histogram(AngleSummary(shared=float("nan"), subclass=float("nan"),
                                          angles=arrays[ANGLES], classes=0),
                             path, f"principal angles, class vs rest — {title}")
        written.append(path)
    return written


__all__ = ["plot_diagnostics", "representation_diagnostics"]
