"""The end-of-trial figures a method's or MCL's diagnostics are drawn as, on the driver.

Models and methods compute arrays (:meth:`raycl.methods.Method.diagnostic_arrays`, MCL's
summary in :func:`raycl.worker.stage_integration.mcl_summary`); they travel in the trial's last
checkpoint (``diagnostics.npz``), and :mod:`raycl.trial.trainable` draws them here and logs the
PNGs to the trial's MLflow run. Nothing here trains or clusters: every figure is a function of
its arrays. The spectrum and principal-angle figures are :func:`raycl.eval.diagnostics
.plot_diagnostics`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from raycl.config.metric_names import LINEAR, TEST, metric_name

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (a trial process has no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(figure: Figure, path: Path) -> Path:
    """Writes ``figure`` to ``path`` at 100 dpi and frees it."""
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    _pyplot().close(figure)
    return path


def method_figures(arrays: Mapping[str, np.ndarray], out: Path, title: str) -> list[Path]:
    """The figures of every method's diagnostic arrays found in ``arrays`` (keys are prefixed
    with the method's name; ``arrays`` also holds the other diagnostics): FGVR's today.

    Returns:
        The files written into ``out`` (none when no method left arrays).
    """
    return fgvr_figures(arrays, out, title) if "fgvr_triples" in arrays else []


def fgvr_figures(arrays: Mapping[str, np.ndarray], out: Path, title: str) -> list[Path]:
    """``fgvr_triples.png`` (rows: test images; columns: x, x̂, x̂_p) and ``fgvr_scores.png``
    (histograms of the Grad-CAM scores and the bank's variances, with κ), from the arrays of
    :meth:`raycl.methods.fgvr.FGVR.diagnostic_arrays`."""
    plt = _pyplot()
    triples = arrays["fgvr_triples"]
    rows = len(triples)
    figure, axes = plt.subplots(rows, 3, figsize=(4.5, 1.5 * rows), squeeze=False)
    for row, triple in enumerate(triples):
        for column, (image, label) in enumerate(zip(triple, ("x", "x̂", "x̂_p"), strict=True)):
            axis = axes[row][column]
            picture = image.transpose(1, 2, 0)
            axis.imshow(picture[..., 0] if picture.shape[2] == 1 else picture,
                        cmap="gray" if picture.shape[2] == 1 else None)
            axis.set_xticks([])
            axis.set_yticks([])
            if row == 0:
                axis.set_title(label)
    figure.suptitle(f"FGVR reconstructions (test) — {title}", fontsize=8)
    written = [_save(figure, out / "fgvr_triples.png")]

    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    if "fgvr_gradcam_scores" in arrays:
        left.hist(arrays["fgvr_gradcam_scores"].ravel(), bins=50)
    left.set(title="normalised Grad-CAM scores η̄", xlabel="η̄", ylabel="dimensions x images")
    if "fgvr_variance" in arrays:
        right.hist(arrays["fgvr_variance"], bins=50)
        right.axvline(float(arrays["fgvr_kappa"][0]), color="red", label="κ")
        right.legend()
    right.set(title="memory-bank column variance s", xlabel="s", ylabel="dimensions")
    figure.suptitle(title, fontsize=8)
    written.append(_save(figure, out / "fgvr_scores.png"))
    return written


def mcl_figure(
    out: Path,
    ami: np.ndarray,
    sizes: np.ndarray,
    stage_metrics: Sequence[Mapping[str, Any]],
    attributes: Sequence[str],
) -> Path:
    """``mcl_diagnostics.png``: the last stage's pseudo-label group sizes, the AMI between the
    stages' clusterings, and the linear probe's test accuracy of each stage and of their
    integration, per attribute.

    Args:
        out: directory the PNG is written to.
        ami: (S, S) AMI between the clusterings of the S stages.
        sizes: group sizes of the last stage's pseudo labels, largest first.
        stage_metrics: per stage j, its ``stage{j}/test/linear/<attribute>`` scores; the last
            also the integration's ``test/linear/<attribute>`` (missing ones are drawn as NaN).
        attributes: the dataset's attributes (``mean`` is added).

    Returns:
        The file written.
    """
    plt = _pyplot()
    stages = len(stage_metrics)
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
        values = [stage_metrics[j].get(metric_name(TEST, LINEAR, attribute, stage=j), math.nan)
                  for j in range(stages)]
        values.append(stage_metrics[-1].get(metric_name(TEST, LINEAR, attribute), math.nan))
        axes[2].bar(positions + a * width, values, width, label=attribute)
    axes[2].set_xticks(positions + 0.4 - width / 2,
                       [f"stage {j}" for j in range(stages)] + ["integrated"])
    axes[2].set(title="linear probe accuracy (test split)", ylim=(0, 1.05))
    axes[2].legend(fontsize="small")
    return _save(figure, out / "mcl_diagnostics.png")


__all__ = ["fgvr_figures", "mcl_figure", "method_figures"]
