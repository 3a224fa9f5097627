"""Shard sources (stream mode): WebDataset tar shards as img2dataset writes them and Parquet
files with an image column, listed, split by whole shards and read in order (no Ray)."""

from __future__ import annotations

import json
import logging
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from raycl.config.training import DataConfig
from raycl.data.sources.sharded import PARQUET_READER, WEBDATASET_READER, shard_splits
from raycl.data.stream.shards import (
    CHUNK,
    Shard,
    ShardRows,
    list_shards,
    read_captions,
    read_shard,
    shard_chunks_as_columns,
    split_shards,
)
from tests.data_fixtures import sample_colour, write_parquet_images, write_webdataset

SIDE = 8


def data_cfg(root: Path | str, dataset: str = "webdataset", **extra: Any) -> DataConfig:
    fields = {"dataset": dataset, "root": str(root), "val_fraction": 0.1, "test_fraction": 0.1,
              "resolution": SIDE}
    return DataConfig(**{**fields, **extra})


def which_samples(images: np.ndarray, candidates: int = 200) -> list[int]:
    """The sample index whose colour each decoded (one-colour) image is nearest to."""
    colours = np.stack([sample_colour(index) for index in range(candidates)]).astype(float)
    means = images.reshape(len(images), 3, -1).mean(axis=2)
    return [int(np.argmin(((colours - mean) ** 2).sum(axis=1))) for mean in means]


@pytest.mark.parametrize("sizes", ["sizes.json", "stats", "samples_per_shard"])
def test_counts_come_from_sizes_json_stats_or_the_config(tmp_path: Path, sizes: str) -> None:
    write_webdataset(tmp_path, 3, 4, sizes="none" if sizes == "samples_per_shard" else sizes)
    per_shard = 4 if sizes == "samples_per_shard" else None
    shards = list_shards(data_cfg(tmp_path, samples_per_shard=per_shard), "webdataset")
    assert [Path(shard.path).name for shard in shards] == ["00000.tar", "00001.tar", "00002.tar"]
    assert [(shard.count, shard.offset) for shard in shards] == [(4, 0), (4, 4), (4, 8)]


def test_sizes_json_wins_and_no_count_is_one_line_naming_the_three_ways(tmp_path: Path) -> None:
    write_webdataset(tmp_path, 3, 4, sizes="stats")
    (tmp_path / "sizes.json").write_text(json.dumps({"00000.tar": 2, "00001.tar": 3}))
    counts = [shard.count for shard in list_shards(data_cfg(tmp_path), "webdataset")]
    assert counts == [2, 3, 4]  # the third from its _stats.json
    bare = tmp_path / "bare"
    write_webdataset(bare, 3, 4, sizes="none")
    with pytest.raises(ValueError) as error:
        list_shards(data_cfg(bare), "webdataset")
    message = str(error.value)
    assert "\n" not in message and message.startswith("data.root: ")
    for way in ("sizes.json", "00000_stats.json", "data.samples_per_shard"):
        assert way in message


def test_brace_pattern_picks_its_shards_and_names_a_missing_one(tmp_path: Path) -> None:
    write_webdataset(tmp_path, 4, 2)
    shards = list_shards(data_cfg(tmp_path / "{00001..00002}.tar"), "webdataset")
    assert [Path(shard.path).name for shard in shards] == ["00001.tar", "00002.tar"]
    assert [shard.offset for shard in shards] == [0, 2]
    with pytest.raises(ValueError, match=r"00004\.tar.*brace pattern"):
        list_shards(data_cfg(tmp_path / "{00002..00005}.tar"), "webdataset")


def test_missing_shard_of_sizes_json_and_missing_root_are_named(tmp_path: Path) -> None:
    write_webdataset(tmp_path, 3, 2)
    (tmp_path / "00001.tar").unlink()
    with pytest.raises(ValueError, match=r"00001\.tar.*sizes\.json"):
        list_shards(data_cfg(tmp_path), "webdataset")
    with pytest.raises(ValueError, match=r"data\.root: .*nowhere.* does not exist"):
        list_shards(data_cfg(tmp_path / "nowhere"), "webdataset")


def test_split_takes_whole_shards_from_the_end_with_offsets_per_split() -> None:
    shards = [Shard(f"s/{number:05d}.tar", 5, 5 * number) for number in range(10)][::-1]
    splits = split_shards(shards, val_fraction=0.1, test_fraction=0.2)
    names = {split: [Path(shard.path).stem for shard in part] for split, part in splits.items()}
    assert names == {"train": [f"{number:05d}" for number in range(7)],
                     "val": ["00007"], "test": ["00008", "00009"]}
    assert [shard.offset for shard in splits["train"]] == [0, 5, 10, 15, 20, 25, 30]
    assert [shard.offset for shard in splits["test"]] == [0, 5]
    # Each held-out split gets at least one shard, however small its fraction.
    tiny = split_shards(shards[:3], val_fraction=0.01, test_fraction=0.0)
    assert [len(tiny[split]) for split in ("train", "val", "test")] == [1, 1, 1]
    with pytest.raises(ValueError, match=r"data\.root: 2 shard"):
        split_shards(shards[:2], 0.1, 0.1)


def test_read_shard_yields_samples_in_order_with_split_indices(tmp_path: Path) -> None:
    (path,) = write_webdataset(tmp_path, 1, CHUNK + 6)
    chunks = list(read_shard(Shard(str(path), CHUNK + 6, 100), "webdataset", SIDE, True))
    assert [len(chunk.index) for chunk in chunks] == [CHUNK, 6]
    index = np.concatenate([chunk.index for chunk in chunks])
    assert index.tolist() == list(range(100, 100 + CHUNK + 6))
    images = np.concatenate([chunk.images for chunk in chunks])
    assert images.shape == (CHUNK + 6, 3, SIDE, SIDE) and images.dtype == np.uint8
    assert which_samples(images) == list(range(CHUNK + 6))
    assert chunks[1].captions == [f"sample {number}" for number in range(CHUNK, CHUNK + 6)]


def test_corrupt_jpeg_and_captionless_sample_are_skipped_and_named(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (path,) = write_webdataset(tmp_path, 1, 6, bad={0: [1, 5]}, no_caption={0: [3]})
    shard = Shard(str(path), 6, 0)
    with caplog.at_level(logging.WARNING, logger="raycl.data.stream.shards"):
        (chunk,) = read_shard(shard, "webdataset", SIDE, need_captions=True)
    assert chunk.index.tolist() == [0, 2, 4]
    assert which_samples(chunk.images) == [0, 2, 4]
    assert chunk.skipped == [f"{path}:000000001", f"{path}:000000003", f"{path}:000000005"]
    assert "cannot read image" in chunk.reasons[0] and chunk.reasons[1] == "no caption"
    assert f"{path}:000000001" in caplog.text
    # Without captions required only the corrupt images go; the caption-less one reads as "".
    (chunk,) = read_shard(shard, "webdataset", SIDE, need_captions=False)
    assert chunk.index.tolist() == [0, 2, 3, 4] and chunk.captions[2] == ""
    # As Ray Data columns: the skips before each row, the trailing one on the last row.
    (columns,) = shard_chunks_as_columns(shard, "webdataset", SIDE, True)
    assert columns["index"].tolist() == [0, 2, 4]
    assert columns["skipped"].tolist() == [0, 1, 2]
    assert columns["caption"].tolist() == ["sample 0", "sample 2", "sample 4"]


def test_a_shard_without_any_good_sample_yields_nothing_and_an_unreadable_one_raises(
        tmp_path: Path) -> None:
    (path,) = write_webdataset(tmp_path, 1, 3, captions=False)
    assert list(shard_chunks_as_columns(Shard(str(path), 3, 0), "webdataset", SIDE, True)) == []
    broken = tmp_path / "broken.tar"
    broken.write_bytes(b"this is no tar file" * 40)
    with pytest.raises(OSError, match=r"broken\.tar"):
        list(read_shard(Shard(str(broken), 3, 0), "webdataset", SIDE, False))
    # As Ray Data reads it, a shard cut short mid-epoch ends there: its good samples come
    # first, the rest are counted as skipped on the last row, and nothing is raised.
    (whole,) = write_webdataset(tmp_path / "cut", 1, 100)
    cut = tmp_path / "cut.tar"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size * 8 // 10])
    rows = list(shard_chunks_as_columns(Shard(str(cut), 100, 0), "webdataset", SIDE, True))
    read = sum(len(columns["index"]) for columns in rows)
    assert 64 <= read < 100  # at least the first chunk
    assert sum(int(columns["skipped"].sum()) for columns in rows) == 100 - read


def test_rows_cross_shard_boundaries_and_blank_undecodable_samples(tmp_path: Path) -> None:
    write_webdataset(tmp_path, 3, 5, bad={2: [0]})
    rows = ShardRows(list_shards(data_cfg(tmp_path), "webdataset"), "webdataset", SIDE)
    assert rows.shape == (15, 3, SIDE, SIDE) and len(rows) == 15
    batches = list(rows.rows(3, 12, 4))
    assert [len(batch) for batch in batches] == [4, 4, 1]
    images = np.concatenate(batches)
    assert not images[7].any()  # sample 10: the corrupt first sample of the third shard
    assert which_samples(np.delete(images, 7, axis=0)) == [3, 4, 5, 6, 7, 8, 9, 11]
    assert rows.skipped == [f"{tmp_path / '00002.tar'}:000020000"]
    picked = rows[np.array([11, 2, 11, -1])]
    assert which_samples(picked) == [11, 2, 11, 14]
    assert which_samples(rows[6:8]) == [6, 7] and which_samples(rows[4][None]) == [4]


def test_shard_rows_pickle_as_their_shard_list(tmp_path: Path) -> None:
    write_webdataset(tmp_path, 3, 4)
    rows = ShardRows(list_shards(data_cfg(tmp_path), "webdataset"), "webdataset", SIDE)
    data = pickle.dumps(rows)
    assert len(data) < 1000
    back = pickle.loads(data)
    assert back.shards == rows.shards and which_samples(back[5:6]) == [5]


@pytest.mark.parametrize("struct", [False, True])
def test_parquet_files_by_row_groups_with_bytes_or_struct_images(tmp_path: Path,
                                                                 struct: bool) -> None:
    write_parquet_images(tmp_path, 3, 12, struct=struct, row_group_size=5)
    shards = list_shards(data_cfg(tmp_path, "parquet"), "parquet")
    assert [(shard.count, shard.offset) for shard in shards] == [(12, 0), (12, 12), (12, 24)]
    (chunk,) = read_shard(shards[1], "parquet", SIDE, need_captions=True)
    assert chunk.index.tolist() == list(range(12, 24))
    assert which_samples(chunk.images) == list(range(12, 24))
    assert chunk.captions == [f"sample {index}" for index in range(12, 24)]
    rows = ShardRows(shards, "parquet", SIDE)
    assert which_samples(np.concatenate(list(rows.rows(10, 14, 8)))) == [10, 11, 12, 13]


def test_read_captions_reads_text_only_aligned_with_indices(tmp_path: Path) -> None:
    write_webdataset(tmp_path / "wds", 2, 3, no_caption={1: [1]}, bad={0: [0]})
    shards = list_shards(data_cfg(tmp_path / "wds"), "webdataset")
    captions = read_captions(shards, "webdataset")
    assert captions.tolist() == ["sample 0", "sample 1", "sample 2", "sample 3", "", "sample 5"]
    write_parquet_images(tmp_path / "pq", 1, 4, captions=False)
    assert read_captions(list_shards(data_cfg(tmp_path / "pq", "parquet"), "parquet"),
                         "parquet") is None


def test_readers_check_split_and_refuse_memory_mode(tmp_path: Path) -> None:
    write_webdataset(tmp_path / "two", 2, 3)
    problem = WEBDATASET_READER.check(data_cfg(tmp_path / "two"))
    assert problem is not None and problem.key == "root"
    assert re.match(r"2 shard.*at least 3", problem.why) and "\n" not in problem.why
    with pytest.raises(ValueError, match=r"webdataset is streamed only; set data\.loader: stream"):
        WEBDATASET_READER.read(data_cfg(tmp_path / "two"), 0)
    problem = PARQUET_READER.check(data_cfg(tmp_path / "two", "parquet"))
    assert problem is not None and problem.key == "root"
    assert re.search(r"no \.parquet file", problem.why)
    write_webdataset(tmp_path / "four", 4, 3, no_caption={3: [2]})
    cfg = data_cfg(tmp_path / "four")
    assert WEBDATASET_READER.check(cfg) is None
    assert WEBDATASET_READER.class_counts(cfg) == {"all": [12]}
    assert WEBDATASET_READER.split_sizes(cfg) == {"train": 6, "val": 3, "test": 3}
    assert WEBDATASET_READER.content_key(cfg, 0)["shards"][0] == ["00000.tar", 3]
    splits = shard_splits(cfg, seed=0)
    assert [len(splits.split(name).images) for name in ("train", "val", "test")] == [6, 3, 3]
    assert splits.train.captions is None and splits.attributes == []
    assert splits.test.captions.tolist() == ["sample 9", "sample 10", ""]
    assert which_samples(splits.val.images[0:3]) == [6, 7, 8]


def test_shards_in_an_s3_bucket_are_listed_and_read(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.local_servers import moto_s3

    with moto_s3(monkeypatch) as (client, port):
        client.create_bucket(Bucket="raycl-shards")
        paths = write_webdataset(tmp_path, 3, 4, bad={1: [3]})
        for path in [*paths, tmp_path / "sizes.json"]:
            client.upload_file(str(path), "raycl-shards", f"wds/{path.name}")
        query = f"?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
        shards = list_shards(data_cfg(f"s3://raycl-shards/wds{query}"), "webdataset")
        assert [(shard.path, shard.count) for shard in shards] == [
            (f"s3://raycl-shards/wds/0000{number}.tar{query}", 4) for number in range(3)]
        braced = list_shards(data_cfg(f"s3://raycl-shards/wds/{{00001..00002}}.tar{query}"),
                             "webdataset")
        assert [shard.path for shard in braced] == [shard.path for shard in shards[1:]]
        rows = ShardRows(shards, "webdataset", SIDE)
        images = np.concatenate(list(rows.rows(2, 9, 4)))
        assert which_samples(np.delete(images, 5, axis=0)) == [2, 3, 4, 5, 6, 8]
        assert not images[5].any() and rows.skipped == [f"{shards[1].path}:000010003"]
        assert read_captions(shards[2:], "webdataset").tolist() == [
            f"sample {index}" for index in range(8, 12)]
        with pytest.raises(ValueError, match=r"00003\.tar.*brace pattern"):
            list_shards(data_cfg(f"s3://raycl-shards/wds/{{00001..00005}}.tar{query}"),
                        "webdataset")
        for root in (f"s3://raycl-shards/nothing{query}", f"s3://raycl-no-bucket/wds{query}"):
            with pytest.raises(ValueError, match=r"^data\.root: ") as error:
                list_shards(data_cfg(root), "webdataset")
            assert "\n" not in str(error.value) and root in str(error.value)
