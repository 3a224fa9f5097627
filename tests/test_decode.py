"""One decode for every path (issue 32): the same JPEG and PNG file gives the same pixels in the
memory cache (a folder's cache build), in stream mode (FileRows, and the same bytes in a
WebDataset shard) and in evaluation (a MMVP-VLM download). No Ray."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from raycl.config.training import DataConfig
from raycl.data import load_image_set
from raycl.data.decode import decode_square
from raycl.data.stream.files import FileRows
from raycl.data.stream.shards import Shard, ShardRows
from raycl.eval.mmvp import load_mmvp_vlm

SIDE = 16


def _pixels(height: int, width: int, seed: int) -> np.ndarray:
    """Smooth gradients plus noise: a JPEG of it decoded at reduced scale (the draft shortcut
    stream mode once took) differs from the whole decode."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    base = np.stack([xs * 255 // width, ys * 255 // height, (xs + ys) % 256], axis=-1)
    return np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8)


@pytest.fixture
def encoded() -> dict[str, bytes]:
    """A landscape JPEG several times the target side and a portrait PNG, as bytes."""
    files = {}
    for name, fmt, shape in (("photo.jpg", "JPEG", (150, 200)), ("scan.png", "PNG", (70, 45))):
        buffer = io.BytesIO()
        Image.fromarray(_pixels(*shape, seed=len(files))).save(buffer, format=fmt)
        files[name] = buffer.getvalue()
    return files


def _memory(tmp_path: Path, encoded: dict[str, bytes]) -> np.ndarray:
    """The rows a folder's cache build decodes (memory mode), in file-name order."""
    root = tmp_path / "folder"
    (root / "only").mkdir(parents=True)
    for name, data in encoded.items():
        (root / "only" / name).write_bytes(data)
    cfg = DataConfig(dataset="folder", root=str(root), resolution=SIDE, loader="memory",
                     cache_dir=str(tmp_path / "cache"), decode_workers=1)
    return np.asarray(load_image_set(cfg, seed=0).images)


def _shard(tmp_path: Path, encoded: dict[str, bytes]) -> np.ndarray:
    """The rows stream mode decodes from a WebDataset shard holding the same bytes."""
    path = tmp_path / "00000.tar"
    with tarfile.open(path, "w") as archive:
        for position, (name, data) in enumerate(sorted(encoded.items())):
            info = tarfile.TarInfo(f"{position:09d}.{name.rsplit('.', 1)[1]}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return ShardRows([Shard(str(path), len(encoded), 0)], "webdataset", SIDE)[0:len(encoded)]


def _evaluation(tmp_path: Path, encoded: dict[str, bytes]) -> np.ndarray:
    """The rows of a MMVP-VLM download holding the same files as one pair (its layout names
    every image ``<id>.jpg``; Pillow reads a file by its content)."""
    root = tmp_path / "mmvp"
    (root / "MLLM_VLM Images" / "Color").mkdir(parents=True)
    (root / "Questions.csv").write_text("Question ID,Type,Statement\n1,Color,a\n2,Color,b\n")
    for qid, name in enumerate(sorted(encoded), start=1):
        (root / "MLLM_VLM Images" / "Color" / f"{qid}.jpg").write_bytes(encoded[name])
    mmvp = load_mmvp_vlm(root, resolution=SIDE)
    assert mmvp is not None
    return mmvp.images


def test_memory_stream_and_evaluation_decode_the_same_pixels(
        tmp_path: Path, encoded: dict[str, bytes]) -> None:
    names = sorted(encoded)  # photo.jpg, scan.png: the folder's listing order
    memory = _memory(tmp_path, encoded)
    assert memory.shape == (2, 3, SIDE, SIDE) and memory.dtype == np.uint8
    rows = FileRows([str(tmp_path / "folder" / "only" / name) for name in names], SIDE)
    files = rows[:]
    assert rows.skipped == []
    for path, decoded in (("stream files", files), ("stream shard", _shard(tmp_path, encoded)),
                          ("evaluation", _evaluation(tmp_path, encoded)),
                          ("bytes", np.stack([decode_square(encoded[n], SIDE) for n in names]))):
        np.testing.assert_array_equal(decoded, memory, err_msg=path)
    # The JPEG is large enough that a reduced-scale (draft) decode would differ: the check
    # above compares pixels that a second decoder could get wrong.
    with Image.open(io.BytesIO(encoded["photo.jpg"])) as image:
        image.draft("RGB", (2 * SIDE, 2 * SIDE))
        assert image.size != (200, 150)


def test_an_undecodable_file_is_one_line_naming_it(tmp_path: Path) -> None:
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"^cannot read image '.*broken\.png': not an image "
                                         r"Pillow can decode$"):
        decode_square(broken, SIDE)
    with pytest.raises(ValueError, match=r"^cannot read image 'key7': not an image"):
        decode_square(b"not a png", SIDE, "key7")
