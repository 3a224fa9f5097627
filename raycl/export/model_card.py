"""The model card: a JSON file beside an exported encoder saying what it is and how to load it.

It holds the method, the trial's whole config, its validation objective and test scores (as
the caller passes them: raycl.export reads them from the trial's MLflow run), the input
preprocessing (resolution, channels, normalisation, crop), the backbone and stem, the format,
the files written, the Python lines that load it, and the git commit of raycl that trained it;
a small_cnn encoder's card also describes its ``architecture``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

MODEL_CARD_SUFFIX = ".model_card.json"
CARD_VERSION = 1


def card_path(exported: Path) -> Path:
    """Where the model card of the file ``exported`` goes: ``<file>.model_card.json``."""
    exported = Path(exported)
    return exported.with_name(exported.name + MODEL_CARD_SUFFIX)


def git_commit(directory: Path | None = None) -> str | None:
    """The git commit of the raycl source tree (``git rev-parse HEAD``), None outside git.

    Args:
        directory: where to ask git (by default the directory of this file).

    Returns:
        The 40-hex commit, or None when git or the repository is not there.
    """
    where = directory or Path(__file__).resolve().parent
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True,
                                text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = result.stdout.strip()
    return commit if result.returncode == 0 and commit else None


def build_model_card(
    *,
    method: str,
    config: dict[str, Any],
    export_format: str,
    files: list[str],
    preprocessing: dict[str, Any],
    backbone: str,
    stem: str | None,
    how_to_load: str,
    objective: dict[str, Any] | None = None,
    test_scores: dict[str, float] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The model card's JSON values.

    Args:
        method: the trained method (MCL: ``mcl(<base>)``).
        config: the trial's config as JSON values.
        export_format: the format written (torchvision, timm, ...).
        files: the files written, relative to the card's directory, main file first.
        preprocessing: :meth:`raycl.export.encoder.Preprocessing.to_dict`.
        backbone: ``model.backbone`` or the open_clip model.
        stem: the ResNet stem ("cifar"/"imagenet"), None for other backbones.
        how_to_load: Python lines that load the file with plain torch / torchvision / timm /
            open_clip.
        objective: the trial's validation objective ``{"metric", "mode", "value"}``.
        test_scores: the trial's test metrics (name -> value).
        extra: more entries (MCL integration, feature dimension, small_cnn's architecture...).

    Returns:
        The card, JSON-serialisable.
    """
    return {
        "raycl_model_card": CARD_VERSION,
        "method": method,
        "format": export_format,
        "files": list(files),
        "backbone": backbone,
        "stem": stem,
        "preprocessing": dict(preprocessing),
        "resolution": preprocessing.get("resolution"),
        "channels": preprocessing.get("channels"),
        "normalisation": {"mean": preprocessing.get("mean"), "std": preprocessing.get("std")},
        # how the trial's dataset was cropped and resized (issue 47: not bicubic for all)
        "resize": preprocessing.get("crop"),
        "validation_objective": objective,
        "test_scores": dict(test_scores or {}),
        "how_to_load": how_to_load,
        "git_commit": git_commit(),
        **(extra or {}),
        "config": config,
    }


def write_model_card(exported: Path, card: dict[str, Any]) -> Path:
    """Writes ``card`` beside ``exported``; returns the card's path."""
    path = card_path(exported)
    path.write_text(json.dumps(card, indent=2, sort_keys=False) + "\n")
    return path


def read_model_card(exported: Path) -> dict[str, Any]:
    """The model card beside ``exported``.

    Raises:
        ValueError: there is none, or it is not a raycl model card.
    """
    path = card_path(exported)
    if not path.is_file():
        raise ValueError(f"{exported}: no model card {path.name} beside it (raycl.export writes "
                         f"one; it says how the file loads)")
    card = json.loads(path.read_text())
    if not isinstance(card, dict) or "raycl_model_card" not in card:
        raise ValueError(f"{path} is not a raycl model card")
    return card


__all__ = ["MODEL_CARD_SUFFIX", "build_model_card", "card_path", "git_commit",
           "read_model_card", "write_model_card"]
