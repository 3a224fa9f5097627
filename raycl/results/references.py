"""The references ``python -m raycl.evaluate`` scores beside a trial's encoder (issue 47): the
floor that reads its number.

A random encoder's features already separate many small datasets (0.97 by the linear probe on
sklearn's digits), so a trial's ``transfer/<name>/linear/mean`` means little alone. Beside it,
the same probes score

- ``at_init``: the trial's architecture freshly initialised as its first stage started (the
  trial's seed; ``model.pretrained``'s weights when it set them), no training: what training
  added is the difference;
- ``pixels``: the images' flattened pixels (normalised as the encoders see them), when they fit:
  rows x values per image at most :data:`PIXEL_VALUES_LIMIT`; otherwise skipped, with a note.

Logged into the trial's run as ``transfer/<name>/<reference>/<family>/<attribute>``
(:func:`reference_metrics`): five parts, which no raycl reader takes for a metric of the trial
(:func:`raycl.config.metric_names.maybe_metric`); printed as rows of the command's table
(:func:`table_rows`). ``--no-references`` skips them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from torch import Tensor, nn

from raycl.config.metric_names import TRANSFER
from raycl.config.schema import CoreConfig
from raycl.data import DatasetSplits
from raycl.export.encoder import at_init_encoder

AT_INIT = "at_init"
PIXELS = "pixels"
REFERENCES: tuple[str, ...] = (AT_INIT, PIXELS)
# Pixel features scored at most: rows x values per image (float32: 80 MB). The probes' cost
# grows with both; CIFAR-10 at 32 px (60,000 x 3,072) is over, sklearn's digits far under.
PIXEL_VALUES_LIMIT = 20_000_000

# (reference, its encoder or None when it is not scored, why not).
Reference = tuple[str, nn.Module | None, str | None]


class Pixels(nn.Module):
    """Normalised float images (B, C, H, W) -> their pixels (B, C*H*W)."""

    def forward(self, images: Tensor) -> Tensor:
        return images.flatten(1)


def pixels_skipped(splits: DatasetSplits) -> str | None:
    """Why the pixels are not scored (over :data:`PIXEL_VALUES_LIMIT`), None when they are."""
    rows = len(splits.train.images) + len(splits.test.images)
    per_image = int(np.prod(splits.train.images.shape[1:]))
    if rows * per_image <= PIXEL_VALUES_LIMIT:
        return None
    return (f"{rows} images x {per_image} pixel values = {rows * per_image:,} > "
            f"{PIXEL_VALUES_LIMIT:,}")


def reference_encoders(config: CoreConfig, channels: int, splits: DatasetSplits) -> list[Reference]:
    """The references to score and their encoders (None, with why, for one not scored).

    Args:
        config: the trial's config with the new data.
        channels: the trial's encoder's image channels.
        splits: the new data (its size decides the pixels).

    Returns:
        ``at_init`` then ``pixels``.
    """
    try:
        at_init: Reference = (AT_INIT, at_init_encoder(config, channels), None)
    except (OSError, ValueError, RuntimeError) as exc:  # e.g. model.pretrained moved since
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        at_init = (AT_INIT, None, f"cannot build the untrained encoder: {why}")
    skipped = pixels_skipped(splits)
    return [at_init, (PIXELS, None if skipped else Pixels(), skipped)]


def reference_metrics(metrics: Mapping[str, float], name: str,
                      reference: str) -> dict[str, float]:
    """A reference's ``transfer/<name>/<family>/<x>`` scores as
    ``transfer/<name>/<reference>/<family>/<x>`` (beside the trial's own, never one of them).

    Args:
        metrics: the reference encoder's transfer scores.
        name: the transfer set's name.
        reference: ``at_init`` or ``pixels``.
    """
    prefix = f"{TRANSFER}/{name}/"
    return {f"{prefix}{reference}/{key.removeprefix(prefix)}": value
            for key, value in metrics.items() if key.startswith(prefix)}


def _split_references(metrics: Mapping[str, float], name: str
                      ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """A trial's scores apart from its references', each renamed back to
    ``transfer/<name>/<family>/<x>``."""
    own: dict[str, float] = {}
    references: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        for reference in REFERENCES:
            prefix = f"{TRANSFER}/{name}/{reference}/"
            if key.startswith(prefix):
                references.setdefault(reference, {})[
                    f"{TRANSFER}/{name}/{key.removeprefix(prefix)}"] = value
                break
        else:
            own[key] = value
    return own, references


def table_rows(trials: Sequence[tuple[str, Mapping[str, float]]], name: str
               ) -> list[tuple[str, dict[str, float]]]:
    """The command's table: each trial's row then its ``<trial>/at_init`` row; the pixels last,
    one ``pixels`` row when every trial's are the same (the same data at the same resolution),
    else ``<trial>/pixels`` each.

    Args:
        trials: (trial label, every metric it logged now).
        name: the transfer set's name.

    Returns:
        (row label, ``transfer/<name>/...`` scores) rows for
        :func:`raycl.evaluate.print_table`.
    """
    rows: list[tuple[str, dict[str, float]]] = []
    pixels: list[tuple[str, dict[str, float]]] = []
    for label, metrics in trials:
        own, references = _split_references(metrics, name)
        rows.append((label, own))
        if AT_INIT in references:
            rows.append((f"{label}/{AT_INIT}", references[AT_INIT]))
        if PIXELS in references:
            pixels.append((f"{label}/{PIXELS}", references[PIXELS]))
    if pixels and all(scores == pixels[0][1] for _, scores in pixels):
        return [*rows, (PIXELS, pixels[0][1])]
    return rows + pixels


__all__ = ["AT_INIT", "PIXELS", "PIXEL_VALUES_LIMIT", "REFERENCES", "Pixels", "at_init_encoder",
           "pixels_skipped", "reference_encoders", "reference_metrics", "table_rows"]
