"""A trial's encoder as its MLflow run holds it: the ``encoder/`` artifact (issue 35).

When a trial ends with a checkpoint, the sweep logs its encoder into the trial's own run
(:mod:`raycl.results.run_encoder`): the weights, written as ``python -m raycl.export`` writes
them (:func:`raycl.export.formats.write_encoder`), and their model card. This module reads that
artifact back, so a run leads to its encoder after ``ray_results/`` is gone:

    encoder, pre = raycl.load_encoder("runs:/<run_id>/encoder")   # or a downloaded copy of it

It imports no Ray; MLflow only for a ``runs:/`` URI.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from raycl.export.model_card import MODEL_CARD_SUFFIX

if TYPE_CHECKING:
    from torch import nn

    from raycl.export.modules import Preprocessing

# The artifact path of a trial's logged encoder in its run, and the tag saying it is there
# (its value: the ``runs:/`` URI that raycl.load_encoder takes).
ENCODER_ARTIFACT = "encoder"
ENCODER_TAG = "raycl.encoder"
RUNS_SCHEME = "runs:/"


def run_encoder_uri(run_id: str) -> str:
    """``runs:/<run_id>/encoder``: where a trial run's logged encoder is."""
    return f"{RUNS_SCHEME}{run_id}/{ENCODER_ARTIFACT}"


def exported_file_in(directory: Path) -> Path:
    """The exported encoder file of an ``encoder/`` artifact folder: the file its one model
    card (``<file>.model_card.json``) describes.

    Args:
        directory: a downloaded ``encoder/`` artifact (or any folder of one raycl export).

    Returns:
        The path of the main file (it may not exist; the loader then says so).

    Raises:
        ValueError: no model card in the folder, or more than one.
    """
    cards = sorted(Path(directory).glob(f"*{MODEL_CARD_SUFFIX}"))
    if len(cards) != 1:
        found = "none" if not cards else ", ".join(card.name for card in cards)
        raise ValueError(f"{directory}: expected one raycl model card "
                         f"(*{MODEL_CARD_SUFFIX}) in an encoder folder, found {found}")
    return cards[0].with_name(cards[0].name.removesuffix(MODEL_CARD_SUFFIX))


def is_encoder_folder(path: Path) -> bool:
    """Whether ``path`` is a folder of an exported encoder (a model card, no ``state.pt``):
    a downloaded ``encoder/`` artifact rather than a checkpoint directory."""
    return (path.is_dir() and not (path / "state.pt").exists()
            and any(path.glob(f"*{MODEL_CARD_SUFFIX}")))


def _tracking_uri() -> str:
    """The MLflow store a ``runs:/`` URI is read from: MLflow's own setting
    (``$MLFLOW_TRACKING_URI`` or ``mlflow.set_tracking_uri``), else raycl's default."""
    import mlflow

    from raycl.config.sweep import DEFAULT_TRACKING_URI, resolve_tracking_uri

    if mlflow.is_tracking_uri_set():
        return mlflow.get_tracking_uri()
    return resolve_tracking_uri(DEFAULT_TRACKING_URI)


def download_run_encoder(uri: str, into: Path, tracking_uri: str | None = None) -> Path:
    """Download a ``runs:/<run_id>/encoder`` artifact into ``into``; its exported file.

    Args:
        uri: the artifact's ``runs:/`` URI.
        into: an existing folder the artifact is downloaded into.
        tracking_uri: the MLflow store (None: :func:`_tracking_uri`).

    Returns:
        The exported file (its model card beside it).

    Raises:
        FileNotFoundError: the run or its artifact is not there (one line).
    """
    import mlflow

    try:
        local = mlflow.artifacts.download_artifacts(
            artifact_uri=uri, dst_path=str(into), tracking_uri=tracking_uri or _tracking_uri())
    except Exception as exc:  # MlflowException, OSError: a missing run or artifact
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise FileNotFoundError(f"{uri}: cannot download the logged encoder: {why}") from None
    return exported_file_in(Path(local))


def load_run_encoder(path_or_uri: str,
                     tracking_uri: str | None = None) -> tuple[nn.Module, Preprocessing] | None:
    """A logged encoder (``runs:/<run_id>/encoder``, or a local folder of that artifact) as
    (module in eval mode on the CPU, its Preprocessing); None for anything else (an exported
    file, a checkpoint directory), which :func:`raycl.export.encoder.load_encoder` reads.

    Args:
        path_or_uri: the URI or path.
        tracking_uri: the MLflow store of a ``runs:/`` URI (None: MLflow's setting, else
            raycl's default ``sqlite:///mlflow.db``).

    Returns:
        The module and its preprocessing, or None.

    Raises:
        FileNotFoundError: the run or its ``encoder/`` artifact is not there.
        ValueError: the folder holds no single model card.
    """
    from raycl.export.formats import load_exported

    text = str(path_or_uri)
    if text.startswith(RUNS_SCHEME):
        # Loaded into memory, so the download is not kept.
        with tempfile.TemporaryDirectory(prefix="raycl-run-encoder-") as scratch:
            return load_exported(download_run_encoder(text, Path(scratch), tracking_uri))
    path = Path(text.removeprefix("file://")).expanduser()
    if is_encoder_folder(path):
        return load_exported(exported_file_in(path))
    return None


__all__ = ["ENCODER_ARTIFACT", "ENCODER_TAG", "download_run_encoder", "exported_file_in",
           "is_encoder_folder", "load_run_encoder", "run_encoder_uri"]
