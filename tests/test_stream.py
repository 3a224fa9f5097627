"""Stream mode (``data.loader: stream``): batches decoded by Ray Data, the same batches as memory
mode, decoders in the trial's reservation, and whole sweeps through Ray Train, Tune and MLflow
(a worker killed mid-epoch, undecodable images skipped and counted, MCL's stages)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from faults import injected_fault
from PIL import Image
from test_end_to_end import NO_PLOTS, assert_each_epoch_logged_once, runs_of, tiny_config

from raycl.config.search_config import apply_overrides
from raycl.data import load_dataset
from raycl.data.load import choose_loader
from raycl.data.stream.files import FileRows, TooManyUnreadable
from raycl.launch.checks import check_loader
from raycl.launch.placement import data_cpus, trial_bundles, trial_demand
from raycl.sweep.run import settle_loader
from raycl.sweep.tuner import build_tuner
from raycl.worker.loader import IndexedImages, build_loader, trial_training_images
from raycl.worker.stage_integration import StageInputs
from raycl.worker.stream_loader import FileStreamLoader

# No group of their own: on the shared Ray session, they join its group (tests/conftest.py). A
# group of their own started a second Ray session on the other xdist worker, which then idled
# there, taking CPU and memory, until the whole test run ended.

CLASSES, PER_CLASS = 4, 30


def write_folder(root: Path, bad: int = 0) -> Path:
    """CLASSES class folders of PER_CLASS small JPEGs whose colour names their class, and
    ``bad`` files that are not images (one per class from the first)."""
    rng = np.random.default_rng(0)
    for label in range(CLASSES):
        folder = root / f"class{label}"
        folder.mkdir(parents=True)
        for i in range(PER_CLASS):
            pixels = np.zeros((20, 24, 3), np.uint8)
            pixels[..., label % 3] = 80 + 40 * (label // 3) + rng.integers(0, 30)
            pixels[: 2 + i % 10] = 255  # a band whose height tells the images apart
            Image.fromarray(pixels).save(folder / f"{i:03d}.jpg", quality=95)
        if label < bad:
            (folder / "zz_broken.jpg").write_bytes(b"\xff\xd8 this is not a jpeg")
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_folder(tmp_path_factory.mktemp("stream") / "images", bad=3)


class _Session:
    rank, world_size, device = 0, 1, torch.device("cpu")


def test_stream_batches_are_memory_mode_batches(ray_session, folder, tmp_path, caplog) -> None:
    """For the same seed and epoch a streamed epoch yields the batches the memory-mode sampler
    draws, decoded to the same pixels, in order; an undecodable file is replaced by a spare
    sample of the split (never a copy of a row of its batch: issue 33), counted (data/skipped)
    every epoch and named once; past data.max_skipped_share the epoch fails naming it."""
    config = tiny_config(tmp_path, "quickstart.yaml", "data.dataset=folder",
                         f"data.root={folder}", "data.resolution=16", "data.loader=stream",
                         "train.batch_size=16", "data.max_skipped_share=0.1")
    data = load_dataset(config.data, config.seed)
    images = data.train.images
    assert isinstance(images, FileRows) and len(images) == len(data.train.labels["class"])
    loader = build_loader(config, trial_training_images(config, data, _Session.device),
                          StageInputs(), _Session())
    assert isinstance(loader, FileStreamLoader)
    loader.set_epoch(3)
    torch.manual_seed(7)  # one rank: the sampler shuffles with torch's seed (set per epoch)
    expected = [list(batch) for batch in loader.batch_sampler]
    torch.manual_seed(7)
    with caplog.at_level(logging.WARNING, logger="raycl.worker.stream_loader"):
        streamed = list(loader)
    assert len(streamed) == len(loader) == len(expected)
    decoded = IndexedImages(images)
    broken = {i for i, path in enumerate(images.paths) if path.endswith("zz_broken.jpg")}
    replaced = 0
    for batch, rows in zip(streamed, expected, strict=True):
        index = batch.index.tolist()
        good = [j for j, row in enumerate(rows) if row not in broken]
        assert [index[j] for j in good] == [rows[j] for j in good] and batch.captions is None
        assert len(set(index)) == len(index) and broken.isdisjoint(index)  # spares, no copies
        reference, _ = decoded.__getitems__(index)  # every row is its index's pixels
        assert torch.equal(batch.images, reference)
        replaced += len(rows) - len(good)
    assert replaced == len(broken) > 0  # each broken training file met once per epoch
    skipped = loader.pop_metrics()["data/skipped"]
    assert skipped >= len(broken)  # and spares that failed too
    assert loader.pop_metrics()["data/skipped"] == 0.0  # counted per epoch
    named = [record.getMessage() for record in caplog.records
             if record.name == "raycl.worker.stream_loader"]
    assert len(named) == len(broken) and all("zz_broken.jpg" in line for line in named)
    caplog.clear()
    loader.set_epoch(4)
    with caplog.at_level(logging.WARNING, logger="raycl.worker.stream_loader"):
        assert len(list(loader)) == len(expected)
    assert loader.pop_metrics()["data/skipped"] >= len(broken)  # counted again, not named again
    assert not [record for record in caplog.records
                if record.name == "raycl.worker.stream_loader"]
    strict = build_loader(apply_overrides(config, {"data.max_skipped_share": 0.0}),
                          trial_training_images(config, data, _Session.device), StageInputs(),
                          _Session())
    with pytest.raises(TooManyUnreadable, match=r"max_skipped_share.*zz_broken\.jpg"):
        list(strict)


def test_two_ranks_stream_equal_disjoint_shares(ray_session, folder, tmp_path) -> None:
    """Under DDP each rank streams its share of every global batch: the same number of batches
    on both ranks (no rank enters a collective alone), disjoint within an epoch, together the
    distributed sampler's epoch."""
    config = tiny_config(tmp_path, "quickstart.yaml", "data.dataset=folder",
                         f"data.root={folder}", "data.resolution=16", "data.loader=stream",
                         "train.batch_size=16", "data.max_skipped_share=0.1")
    data = load_dataset(config.data, config.seed)
    images = trial_training_images(config, data, _Session.device)
    ranks = []
    for rank in (0, 1):
        session = _Session()
        session.rank, session.world_size = rank, 2
        loader = build_loader(config, images, StageInputs(), session)
        loader.set_epoch(1)
        ranks.append([batch.index.tolist() for batch in loader])
    assert len(ranks[0]) == len(ranks[1]) == len(data.train.images) // 2 // 8
    assert all(len(batch) == 8 for batches in ranks for batch in batches)
    # A global batch never holds a sample twice (a broken file's spare comes from another step).
    assert all(len(set(first) | set(second)) == 16 for first, second in zip(*ranks, strict=True))
    broken = {i for i, path in enumerate(data.train.images.paths) if "zz_broken" in path}
    seen = [row for batches in ranks for batch in batches for row in batch]
    assert broken and broken.isdisjoint(seen)


def test_loader_choice_and_the_decoders_reservation(
    folder, tmp_path, capsys, monkeypatch
) -> None:
    streamed = tiny_config(tmp_path, "quickstart.yaml", "data.dataset=folder",
                           f"data.root={folder}", "data.resolution=16", "data.loader=stream",
                           "scaling.num_workers=2", "scaling.cpus_per_worker=1")
    config = apply_overrides(streamed, {"data.loader": "auto"})
    # auto: memory while the decoded set fits the share of a node, else stream, printed once.
    decoded = (CLASSES * PER_CLASS + 3) * 3 * 16 * 16
    assert choose_loader(config.data, node_memory=4 * decoded)[0] == "memory"
    choice, why = choose_loader(config.data, node_memory=decoded)
    assert choice == "stream" and "over data.memory_share (0.5)" in why
    # Settled once at launch, printed, and every trial gets the choice.
    monkeypatch.setattr("raycl.sweep.run.smallest_node_memory", lambda _config: float(decoded))
    assert settle_loader(config).data.loader == "stream"
    assert "raycl: data.loader auto -> stream (" in capsys.readouterr().out
    assert data_cpus(config) == 0.0
    assert trial_bundles(config) == [{"CPU": 0.01}, {"CPU": 1.0}, {"CPU": 1.0}]
    streamed = apply_overrides(streamed, {"data.stream_cpus": 1.5})
    # Each worker's bundle holds its decoders' CPUs beside its own (one node); the feasibility
    # check counts them.
    assert trial_bundles(streamed) == [{"CPU": 0.01}, {"CPU": 2.5}, {"CPU": 2.5}]
    assert trial_demand(streamed)["CPU"] == pytest.approx(0.01 + 3.0 + 2.0)
    # Bad combinations: one line naming the key, before launch.
    cifar = apply_overrides(config, {"data.dataset": "cifar10", "data.loader": "stream"})
    assert [p.key for p in check_loader(cifar)] == ["data.loader"]
    shards = apply_overrides(config, {"data.dataset": "webdataset", "data.loader": "memory"})
    assert "streamed only" in next(iter(check_loader(shards))).why
    mcl = apply_overrides(config, {"data.dataset": "webdataset", "data.loader": "stream",
                                   "method": "mcl", "mcl.stages": 2})
    assert [p.key for p in check_loader(mcl)] == ["mcl.negatives"]
    assert not list(check_loader(apply_overrides(mcl, {"mcl.negatives": "mask"})))


def test_streaming_sweep_survives_a_worker_killed_mid_epoch(
    ray_session, folder, tmp_path
) -> None:
    """A streaming sweep on a folder on two CPUs: MCL over SimCLR (two stages: SimCLR's, then
    one whose batches lie within one pseudo label), the trial a Ray Train worker whose Ray Data
    decoders stream its batches on the CPUs its bundle reserves for them (0.25 for training +
    0.5 for decoding). The worker dies halfway through an epoch and resumes from its
    checkpoint; MLflow holds every epoch once. The undecodable images are left out of every
    split (data.skip_unreadable), counted every epoch (data/skipped) and listed (the artifact
    diagnostics/skipped_images.txt). One trial only: a one-stage (SimCLR) trial beside it took
    the path of this trial's stage 0 again, for a whole second Ray Train run."""
    config = tiny_config(
        tmp_path, "mcl_k_n.yaml", "data.dataset=folder", f"data.root={folder}",
        "data.resolution=16", "data.loader=stream", "data.stream_cpus=0.5",
        "train.batch_size=16", "train.epochs=2", "mcl.clusters=2", "mcl.stages=2",
        "tune.num_samples=1", "tune.search_space={}",
        "eval.every_n_epochs=1", "scaling.num_workers=1", "scaling.cpus_per_worker=0.25",
        "data.skip_unreadable=true", "name=stream-sweep", "eval.baseline=false",
        "mlflow.log_encoder=false",
        NO_PLOTS)  # nothing here reads the end-of-trial plots
    marker = tmp_path / "killed"
    with injected_fault(after_epoch=1, mid_epoch=True, marker=marker, settle_seconds=2):
        results = build_tuner(config, None).fit()
    assert marker.read_text() == "1"
    assert all(result.error is None for result in results)

    client, _, children = runs_of(tmp_path, "stream-sweep")
    (child,) = children
    broken = sorted(str(path) for path in folder.rglob("zz_broken.jpg"))
    assert child.info.status == "FINISHED"
    assert child.data.params["data.loader"] == "stream"
    assert child.data.params["mcl.stages"] == "2"
    assert_each_epoch_logged_once(client, child.info.run_id, 4)  # two stages of two epochs
    skipped = client.get_metric_history(child.info.run_id, "data/skipped")
    assert sorted(m.step for m in skipped) == [1, 2, 3, 4]
    assert {m.value for m in skipped} == {len(broken)}  # left out, so never met in training
    listed = Path(client.download_artifacts(child.info.run_id,
                                            "diagnostics/skipped_images.txt", str(tmp_path)))
    assert sorted(line.split("\t")[0] for line in listed.read_text().splitlines()) == broken
    metrics = child.data.metrics
    assert "test/linear/mean" in metrics
    # Pseudo labels from stage 0 drew stage 1's batches.
    assert "stage1/val/linear/mean" in metrics
    assert metrics["stage1/train/sampler_pure_batches"] > 0
