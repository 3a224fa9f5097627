"""The on-disk cache of full image sets: one ``.npz`` per content, named by a hash of
everything that changes it, written atomically so that Ray workers building the same set at
once never read half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from raycl.data.types import ImageSet

# Bump when a generator changes its output, so stale caches are not reused.
CACHE_VERSION = 1


def default_cache_dir() -> Path:
    """$RAYCL_CACHE if set, else ~/.cache/raycl."""
    return Path(os.environ.get("RAYCL_CACHE") or Path.home() / ".cache" / "raycl")


def cache_file(cfg: Any, content: dict[str, Any]) -> Path:
    """Where the full image set of ``cfg`` is cached: ``<cache_dir>/<dataset>-<hash>.npz``.

    Args:
        cfg: DataConfig-like object (dataset, resolution, cache_dir).
        content: the source's own part of the key (:meth:`Reader.content_key
            <raycl.data.types.Reader.content_key>`).
    """
    key: dict[str, Any] = {"version": CACHE_VERSION, "dataset": cfg.dataset,
                           "resolution": int(cfg.resolution), **content}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    return cache_dir / f"{cfg.dataset}-{digest}.npz"


def save_atomically(path: Path, image_set: ImageSet) -> None:
    """Write to a temporary file in the same directory, then rename over `path`.

    Several Ray workers may build the same set at once; os.replace is atomic, so a reader sees
    either no file or a complete one, and the last writer wins with identical content.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {f"label_{name}": values for name, values in image_set.labels.items()}
    # dtype str: an unlabelled set's empty list would otherwise be saved as float64.
    arrays["attributes"] = np.array(list(image_set.labels), dtype=np.str_)
    if image_set.test_mask is not None:
        arrays["test_mask"] = image_set.test_mask
    if image_set.captions is not None:
        # A fixed-width unicode array, so loading needs no pickle.
        arrays["captions"] = np.asarray(image_set.captions, dtype=np.str_)
    handle, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as tmp_file:
            np.savez(tmp_file, images=image_set.images, **arrays)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def load_cached(path: Path) -> ImageSet | None:
    """The cached set, or None when the file is missing or unreadable."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            attributes = [str(name) for name in archive["attributes"]]
            labels = {name: archive[f"label_{name}"] for name in attributes}
            test_mask = archive["test_mask"] if "test_mask" in archive.files else None
            captions = archive["captions"] if "captions" in archive.files else None
            return ImageSet(images=archive["images"], labels=labels, test_mask=test_mask,
                            captions=captions)
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return None
