"""Tiny copies of the named datasets, written in exactly the format each is distributed in, so
tests read them through the same code a user runs on the real files.

- CIFAR-10 / CIFAR-100: the "python version" pickles (``cifar-10-batches-py/``,
  ``cifar-100-python/``), opcode for opcode as Python 2 wrote them: protocol 2, Python 2 ``str``
  keys and values (they load as ``bytes`` with ``encoding="bytes"``), a numpy array pickled as
  ``numpy.core.multiarray._reconstruct``; ``data`` is uint8 (N, 3072), row-major R, G, B planes.
- STL-10: ``stl10_binary/`` with the raw uint8 ``*_X.bin`` (each image's channels stored
  column-major), uint8 labels 1..10 in ``*_y.bin``, ``class_names.txt`` and ``fold_indices.txt``.
- ImageNet: ``train/<wnid>/<wnid>_<n>.JPEG`` and ``val/<wnid>/ILSVRC2012_val_<8 digits>.JPEG``
  (val sorted into class folders, as the usual preparation script leaves it).

Every writer returns the directory to put in ``data.root``. Images carry one colour per class
(plus noise), so a linear probe on them beats chance.
"""

from __future__ import annotations

import colorsys
import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

CIFAR10_NAMES: tuple[str, ...] = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog",
                                  "horse", "ship", "truck")
STL10_NAMES: tuple[str, ...] = ("airplane", "bird", "car", "cat", "deer", "dog", "horse",
                                "monkey", "ship", "truck")
STL10_SIDE = 96
CIFAR_SIDE = 32
CIFAR10_TRAIN_BATCHES = 5


# numpy's objects a CIFAR pickle names, under the module names Python 2's numpy wrote.
_PYTHON2_GLOBALS: dict[str, bytes] = {
    "_reconstruct": b"numpy.core.multiarray\n_reconstruct\n",
    "ndarray": b"numpy\nndarray\n",
    "dtype": b"numpy\ndtype\n",
}


class _Python2Pickler(pickle._Pickler):  # type: ignore[name-defined]
    """Pickles as Python 2's cPickle wrote the CIFAR files: ``bytes`` and ASCII ``str`` (keys,
    names, numpy's dtype codes, the array's raw data) as Python 2 ``str`` (opcodes
    SHORT_BINSTRING / BINSTRING), numpy's array reconstructor as ``numpy.core.multiarray``."""

    dispatch = pickle._Pickler.dispatch.copy()  # type: ignore[attr-defined]

    def _save_python2_str(self, obj: bytes | str) -> None:
        data = obj.encode("ascii") if isinstance(obj, str) else obj
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[bytes] = _save_python2_str
    dispatch[str] = _save_python2_str

    def save_global(self, obj: Any, name: str | None = None) -> None:
        python2_name = _PYTHON2_GLOBALS.get(getattr(obj, "__name__", ""))
        if python2_name is None or getattr(obj, "__module__", "").split(".")[0] != "numpy":
            super().save_global(obj, name)
            return
        self.write(pickle.GLOBAL + python2_name)
        self.memoize(obj)


def dump_python2_pickle(obj: Any, path: Path) -> None:
    """Write ``obj`` as the CIFAR pickles are written: protocol 2, bytes as Python 2 str."""
    with open(path, "wb") as handle:
        _Python2Pickler(handle, protocol=2).dump(obj)


def class_colour(index: int) -> np.ndarray:
    """A distinct RGB colour (uint8 (3,)) for class ``index``: hues spread by the golden ratio,
    three brightness levels so that 100 classes stay apart."""
    hue = (index * 0.618033988749895) % 1.0
    value = (1.0, 0.7, 0.45)[index % 3]
    red, green, blue = colorsys.hsv_to_rgb(hue, 0.85, value)
    return np.array([red, green, blue]) * 255.0


def class_images(labels: np.ndarray, height: int, width: int,
                 rng: np.random.Generator) -> np.ndarray:
    """uint8 (N, 3, height, width) images, each its class's colour plus noise (label -1: a
    random colour)."""
    colours = np.stack([class_colour(int(label)) if label >= 0 else rng.uniform(0, 255, 3)
                        for label in labels]) if len(labels) else np.zeros((0, 3))
    noise = rng.normal(0.0, 18.0, (len(labels), 3, height, width))
    return np.clip(colours[:, :, None, None] + noise, 0, 255).round().astype(np.uint8)


def _balanced_labels(num_classes: int, per_class: int, rng: np.random.Generator) -> np.ndarray:
    """``per_class`` labels of each class, shuffled (the real files are not sorted by class)."""
    return rng.permutation(np.repeat(np.arange(num_classes), per_class)).astype(np.int64)


def cifar_rows(images: np.ndarray) -> np.ndarray:
    """uint8 (N, 3, 32, 32) -> the CIFAR ``data`` rows (N, 3072): the R plane row by row, then
    G, then B."""
    return np.ascontiguousarray(images.reshape(len(images), 3 * CIFAR_SIDE * CIFAR_SIDE))


def _cifar_filenames(labels: np.ndarray, names: list[str], offset: int) -> list[bytes]:
    return [f"{names[int(label)]}_s_{offset + i:06d}.png".encode()
            for i, label in enumerate(labels)]


def write_cifar10(root: Path, per_class_train: int = 3, per_class_test: int = 2,
                  seed: int = 0) -> Path:
    """``root/cifar-10-batches-py/`` with ``data_batch_1..5``, ``test_batch`` and
    ``batches.meta``; the training images dealt over the five batches.

    Returns:
        ``root`` (data.root; the batches directory itself works too).
    """
    rng = np.random.default_rng(seed)
    directory = Path(root) / "cifar-10-batches-py"
    directory.mkdir(parents=True, exist_ok=True)
    names = list(CIFAR10_NAMES)
    train_labels = _balanced_labels(10, per_class_train, rng)
    test_labels = _balanced_labels(10, per_class_test, rng)
    batches = np.array_split(np.arange(len(train_labels)), CIFAR10_TRAIN_BATCHES)
    for number, rows in enumerate(batches, start=1):
        labels = train_labels[rows]
        dump_python2_pickle({
            b"batch_label": f"training batch {number} of 5".encode(),
            b"labels": [int(label) for label in labels],
            b"data": cifar_rows(class_images(labels, CIFAR_SIDE, CIFAR_SIDE, rng)),
            b"filenames": _cifar_filenames(labels, names, int(rows[0]) if len(rows) else 0),
        }, directory / f"data_batch_{number}")
    dump_python2_pickle({
        b"batch_label": b"testing batch 1 of 1",
        b"labels": [int(label) for label in test_labels],
        b"data": cifar_rows(class_images(test_labels, CIFAR_SIDE, CIFAR_SIDE, rng)),
        b"filenames": _cifar_filenames(test_labels, names, 0),
    }, directory / "test_batch")
    dump_python2_pickle({b"num_cases_per_batch": len(batches[0]),
                         b"label_names": [name.encode() for name in names],
                         b"num_vis": 3 * CIFAR_SIDE * CIFAR_SIDE}, directory / "batches.meta")
    return Path(root)


def write_cifar100(root: Path, per_class_train: int = 1, per_class_test: int = 1,
                   seed: int = 0) -> Path:
    """``root/cifar-100-python/`` with ``train``, ``test`` and ``meta``: all 100 fine classes,
    coarse label = fine // 5 (a fixture's grouping; the real one groups by meaning).

    Returns:
        ``root`` (data.root; the ``cifar-100-python`` directory itself works too).
    """
    rng = np.random.default_rng(seed)
    directory = Path(root) / "cifar-100-python"
    directory.mkdir(parents=True, exist_ok=True)
    fine_names = [f"fine_{index:02d}" for index in range(100)]
    for split, per_class, title in (("train", per_class_train, "training"),
                                    ("test", per_class_test, "testing")):
        fine = _balanced_labels(100, per_class, rng)
        dump_python2_pickle({
            b"filenames": _cifar_filenames(fine, fine_names, 0),
            b"batch_label": f"{title} batch 1 of 1".encode(),
            b"fine_labels": [int(label) for label in fine],
            b"coarse_labels": [int(label) // 5 for label in fine],
            b"data": cifar_rows(class_images(fine, CIFAR_SIDE, CIFAR_SIDE, rng)),
        }, directory / split)
    dump_python2_pickle({
        b"fine_label_names": [name.encode() for name in fine_names],
        b"coarse_label_names": [f"coarse_{index:02d}".encode() for index in range(20)],
    }, directory / "meta")
    return Path(root)


def stl10_bytes(images: np.ndarray) -> bytes:
    """uint8 (N, 3, H, W) upright images -> the bytes of an STL-10 ``*_X.bin`` (each channel
    stored column by column)."""
    return np.ascontiguousarray(images.transpose(0, 1, 3, 2)).tobytes()


def write_stl10(root: Path, per_class_train: int = 3, per_class_test: int = 2,
                unlabeled: int = 20, seed: int = 0, with_unlabeled: bool = True) -> Path:
    """``root/stl10_binary/`` with ``train_X.bin``, ``train_y.bin``, ``test_X.bin``,
    ``test_y.bin``, ``unlabeled_X.bin`` (when ``with_unlabeled``; random colours),
    ``class_names.txt`` and ``fold_indices.txt``; 96x96 images as the real set's.

    Returns:
        ``root`` (data.root; the ``stl10_binary`` directory itself works too).
    """
    rng = np.random.default_rng(seed)
    directory = Path(root) / "stl10_binary"
    directory.mkdir(parents=True, exist_ok=True)
    for split, per_class in (("train", per_class_train), ("test", per_class_test)):
        labels = _balanced_labels(10, per_class, rng)
        images = class_images(labels, STL10_SIDE, STL10_SIDE, rng)
        (directory / f"{split}_X.bin").write_bytes(stl10_bytes(images))
        (directory / f"{split}_y.bin").write_bytes((labels + 1).astype(np.uint8).tobytes())
    if with_unlabeled:
        images = class_images(np.full(unlabeled, -1), STL10_SIDE, STL10_SIDE, rng)
        (directory / "unlabeled_X.bin").write_bytes(stl10_bytes(images))
    (directory / "class_names.txt").write_text("".join(f"{name}\n" for name in STL10_NAMES))
    # Ten folds of training indices, one line each (the real file's 1 000 per fold).
    folds = [rng.permutation(10 * per_class_train)[:max(1, per_class_train)] for _ in range(10)]
    (directory / "fold_indices.txt").write_text(
        "".join(" ".join(str(index) for index in fold) + " \n" for fold in folds))
    return Path(root)


def _write_jpeg(image: np.ndarray, path: Path) -> None:
    Image.fromarray(image.transpose(1, 2, 0)).save(path, format="JPEG", quality=95)


def write_imagenet(root: Path, wnids: list[str], per_class_train: int = 3,
                   per_class_val: int = 2, size: int = 16, seed: int = 0) -> Path:
    """``root/train/<wnid>/<wnid>_<n>.JPEG`` and ``root/val/<wnid>/ILSVRC2012_val_<n>.JPEG`` for
    each wnid (class index = position in sorted ``wnids``); images ``size`` high and
    ``size * 4 // 3`` wide (most ImageNet photos are 4:3 landscape).

    Returns:
        ``root`` (data.root).
    """
    rng = np.random.default_rng(seed)
    root = Path(root)
    height, width = size, size * 4 // 3
    class_index = {wnid: index for index, wnid in enumerate(sorted(wnids))}
    val_numbers = iter(rng.permutation(len(wnids) * per_class_val) + 1)
    for wnid in wnids:
        label = class_index[wnid]
        for half, count in (("train", per_class_train), ("val", per_class_val)):
            folder = root / half / wnid
            folder.mkdir(parents=True, exist_ok=True)
            images = class_images(np.full(count, label), height, width, rng)
            for image in images:
                name = (f"{wnid}_{int(rng.integers(1, 99_999))}.JPEG" if half == "train"
                        else f"ILSVRC2012_val_{next(val_numbers):08d}.JPEG")
                while (folder / name).exists():  # a repeated random train number
                    name = f"{wnid}_{int(rng.integers(1, 99_999))}.JPEG"
                _write_jpeg(image, folder / name)
    return root


def imagenet100_wnids() -> list[str]:
    """The 100 wnids of ImageNet-100 as raycl ships them (CMC's order)."""
    from raycl.data.sources.imagenet import imagenet100_class_list

    return imagenet100_class_list()


def sample_colour(index: int) -> np.ndarray:
    """uint8 (3,) colour of shard sample ``index`` (its index over all shards): tests tell which
    sample a decoded row is by it."""
    return class_colour(index).round().astype(np.uint8)


def _jpeg_bytes(index: int, size: int) -> bytes:
    import io

    image = np.broadcast_to(sample_colour(index), (size, size, 3)).copy()
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def _add_member(archive: Any, name: str, data: bytes) -> None:
    import io
    import tarfile

    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    archive.addfile(info, io.BytesIO(data))


def write_webdataset(root: Path, shards: int, per_shard: int, size: int = 12,
                     bad: dict[int, list[int]] | None = None, sizes: str = "sizes.json",
                     captions: bool = True,
                     no_caption: dict[int, list[int]] | None = None) -> list[Path]:
    """``root/00000.tar`` ... as img2dataset writes them: per sample ``<key>.jpg`` (a JPEG of
    one colour, :func:`sample_colour` of its index over all shards), ``<key>.txt`` (caption
    ``"sample <index>"``) and ``<key>.json`` (``caption``, ``key``, ``status``), key
    ``<shard:05d><position:04d>``.

    Args:
        bad: shard -> positions whose ``.jpg`` holds bytes that are not an image.
        sizes: ``"sizes.json"`` (``root/sizes.json``), ``"stats"`` (img2dataset's
            ``00000_stats.json`` with ``successes``) or ``"none"`` (no count anywhere).
        captions: write captions (``.txt`` and the json's ``caption``).
        no_caption: shard -> positions written without a caption.

    Returns:
        The shard files in order.
    """
    import json
    import tarfile

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(shards):
        path = root / f"{shard:05d}.tar"
        with tarfile.open(path, "w") as archive:
            for position in range(per_shard):
                index, key = shard * per_shard + position, f"{shard:05d}{position:04d}"
                broken = position in (bad or {}).get(shard, [])
                image = b"not a jpeg" + bytes(40) if broken else _jpeg_bytes(index, size)
                _add_member(archive, f"{key}.jpg", image)
                meta: dict[str, Any] = {"key": key, "status": "success",
                                        "url": f"http://example.com/{index}.jpg"}
                if captions and position not in (no_caption or {}).get(shard, []):
                    _add_member(archive, f"{key}.txt", f"sample {index}".encode())
                    meta["caption"] = f"sample {index}"
                _add_member(archive, f"{key}.json", json.dumps(meta).encode())
        if sizes == "stats":
            (root / f"{shard:05d}_stats.json").write_text(json.dumps(
                {"count": per_shard, "successes": per_shard, "failed_to_download": 0}))
        paths.append(path)
    if sizes == "sizes.json":
        (root / "sizes.json").write_text(json.dumps({path.name: per_shard for path in paths}))
    return paths


def write_parquet_images(root: Path, files: int, per_file: int, size: int = 12,
                         struct: bool = False, captions: bool = True,
                         row_group_size: int = 5) -> list[Path]:
    """``root/00000.parquet`` ... with an ``image`` column (JPEG bytes of
    :func:`sample_colour` of the row's index over all files; with ``struct``, Hugging Face's
    ``{"bytes", "path"}`` struct) and, with ``captions``, a ``caption`` column
    (``"sample <index>"``); row groups of ``row_group_size`` rows.

    Returns:
        The files in order.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for number in range(files):
        indices = range(number * per_file, (number + 1) * per_file)
        images = [_jpeg_bytes(index, size) for index in indices]
        column = (pa.array([{"bytes": data, "path": f"{index}.jpg"}
                            for data, index in zip(images, indices, strict=True)])
                  if struct else pa.array(images, type=pa.binary()))
        table = {"image": column}
        if captions:
            table["caption"] = pa.array([f"sample {index}" for index in indices])
        path = root / f"{number:05d}.parquet"
        pq.write_table(pa.table(table), path, row_group_size=row_group_size)
        paths.append(path)
    return paths
