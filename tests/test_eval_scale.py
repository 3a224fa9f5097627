"""Evaluation at scale (issue 33, findings 1-3): features gathered on rank 0 alone, the training
split embedded only when something reads it, and capped held-out splits.

A stand-in method turns each image (its row index in three bytes) into a fixed feature and
records the rows it embedded, so the tests count what an evaluation embeds and compare the
features a rank holds with the exact array.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from fake_world import run_fake_world
from pydantic import ValidationError
from torch import nn

from raycl.data import DatasetSplits, ImageSet, stratified_subset
from raycl.eval.multimodal import EvalSets
from raycl.eval.scoring import evaluate_features
from raycl.methods import SearchConfig
from raycl.methods.base import Method
from raycl.worker.embed import embed_images
from raycl.worker.evaluate import evaluate_epoch
from raycl.worker.loop import between_stages
from raycl.worker.perf import Clock
from raycl.worker.stage_integration import StageInputs

CLASSES = 4
NO_SETS = EvalSets(transfer=[], mmvp={})


class RowFeatures(Method):
    """Each image is its global row index (three bytes); its feature the row's class centroid
    plus a fixed offset of the row. ``seen`` collects every row embedded."""

    def __init__(self, labels: np.ndarray, dim: int = 8, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.backbone = nn.Identity()
        self.centroids = torch.randn(CLASSES, dim, generator=generator) * 3
        self.frequencies = torch.rand(dim, generator=generator) + 0.1
        self.labels = torch.from_numpy(labels)
        self.seen: list[np.ndarray] = []

    def features_of(self, rows: torch.Tensor) -> torch.Tensor:
        return self.centroids[self.labels[rows]] + torch.sin(rows[:, None].float()
                                                              * self.frequencies)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        digits = ((images[:, :, 0, 0] * 0.5 + 0.5) * 255).round().long()
        rows = digits[:, 0] * 65536 + digits[:, 1] * 256 + digits[:, 2]
        self.seen.append(rows.numpy())
        return self.features_of(rows)


@dataclass
class BareSession:
    """A rank, its world size and its device: what the evaluation asks of a session."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def row_data(sizes: tuple[int, int, int], attributes: bool = True,
             seed: int = 0) -> tuple[DatasetSplits, np.ndarray]:
    """Train, val and test of ``sizes`` rows (images: global row indices), classes drawn
    unevenly (so stratification shows); and every row's label."""
    total = sum(sizes)
    labels = np.random.default_rng(seed).choice(CLASSES, total, p=[0.4, 0.3, 0.2, 0.1])
    index = np.arange(total)
    images = np.stack([index >> 16, (index >> 8) & 255, index & 255], axis=1)
    images = images.astype(np.uint8).reshape(total, 3, 1, 1)
    bounds = np.cumsum([0, *sizes])

    def part(j: int) -> ImageSet:
        rows = slice(bounds[j], bounds[j + 1])
        return ImageSet(images=images[rows],
                        labels={"label": labels[rows]} if attributes else {})

    return DatasetSplits(name="rows", train=part(0), val=part(1), test=part(2),
                         attributes=["label"] if attributes else [],
                         num_classes={"label": CLASSES} if attributes else {}, channels=3,
                         resolution=1), labels.astype(np.int64)


def config_of(method: str = "simclr", **evaluation: Any) -> Any:
    raw: dict[str, Any] = {"name": "eval-scale", "method": method,
                           "eval": {"linear_max_iter": 20, "knn_k": 5, "diagnostics": False,
                                    **evaluation},
                           "scaling": {"num_workers": 0}}
    if method == "mcl":
        raw["mcl"] = {"base": "simclr", "stages": 2, "clusters": 3, "kmeans_iterations": 5}
    return SearchConfig.model_validate(raw)


def seen_in(method: RowFeatures, data: DatasetSplits, split: str) -> np.ndarray:
    """The rows of ``split`` (split-relative) ``method`` embedded, in order."""
    seen = np.concatenate(method.seen) if method.seen else np.zeros(0, dtype=np.int64)
    first = {"train": 0, "val": len(data.train.images),
             "test": len(data.train.images) + len(data.val.images)}[split]
    inside = (seen >= first) & (seen < first + len(data.split(split).images))
    return seen[inside] - first


def test_the_training_split_is_embedded_only_when_something_reads_it() -> None:
    """Finding 3: a run without attributes (an image-text corpus: no probe, no kNN) embeds no
    training row; with ``eval.max_train_samples`` only the probe's stratified rows are embedded
    (the same rows every evaluation) and the scores equal those of the whole split's features
    cut afterwards (the old path); MCL's last epoch embeds every training row (it clusters
    them)."""
    data, labels = row_data((400, 60, 60), attributes=False)
    method = RowFeatures(labels)
    evaluate_epoch(config_of(), data, NO_SETS, StageInputs(), method, BareSession(), last=True)
    assert len(seen_in(method, data, "train")) == 0
    assert len(seen_in(method, data, "val")) == 60
    mcl = config_of("mcl")  # ... but for MCL's clustering at a stage's end, every row
    features, _, _ = evaluate_epoch(mcl, data, NO_SETS, StageInputs(), method, BareSession(),
                                    last=True)
    inputs = between_stages(mcl, StageInputs(), features, {}, None, BareSession(),
                            Clock(time.time()))
    features, _, _ = evaluate_epoch(mcl, data, NO_SETS, inputs, method, BareSession(),
                                    last=True)
    assert len(features["train"]) == 400 and len(inputs.assignments[0]) == 400

    data, labels = row_data((400, 60, 60))
    config = config_of(max_train_samples=100)
    probe_rows = stratified_subset(data.train.labels["label"], 100, config.seed)
    runs = []
    for _ in range(2):
        method = RowFeatures(labels)
        _, metrics, _ = evaluate_epoch(config, data, NO_SETS, StageInputs(), method,
                                       BareSession(), last=False)
        runs.append(seen_in(method, data, "train"))
        np.testing.assert_array_equal(runs[-1], probe_rows)
    whole = {split: method.features_of(torch.arange(len(data.split(split).images))
                                       + {"train": 0, "val": 400}[split]).numpy()
             for split in ("train", "val")}
    expected = evaluate_features(config, data, whole, None, torch.device("cpu"))
    assert {key: metrics[key] for key in expected} == pytest.approx(expected)

    method = RowFeatures(labels)
    evaluate_epoch(config_of("mcl", max_train_samples=100), data, NO_SETS, StageInputs(),
                   method, BareSession(), last=True)
    np.testing.assert_array_equal(np.sort(seen_in(method, data, "train")), np.arange(400))


def test_max_eval_samples_caps_the_held_out_rows_with_the_same_stratified_rows() -> None:
    """Finding 2/3: ``eval.max_eval_samples`` embeds and scores a seeded stratified subset of
    val and test, the same rows at every evaluation; by default every row, as before."""
    data, labels = row_data((200, 300, 300))
    config = config_of(max_eval_samples=50)
    chosen = []
    for _ in range(2):
        method = RowFeatures(labels)
        features, metrics, _ = evaluate_epoch(config, data, NO_SETS, StageInputs(), method,
                                              BareSession(), last=True)
        chosen.append({split: seen_in(method, data, split) for split in ("val", "test")})
        assert {split: len(features[split]) for split in ("val", "test")} == {
            "val": 50, "test": 50}
        assert 0.0 <= metrics["val/linear/mean"] <= 1.0
    for split in ("val", "test"):
        np.testing.assert_array_equal(chosen[0][split], chosen[1][split])
        rows = chosen[0][split]
        counts = np.bincount(data.split(split).labels["label"][rows], minlength=CLASSES)
        share = np.bincount(data.split(split).labels["label"], minlength=CLASSES) / 300
        assert np.all(np.abs(counts - 50 * share) <= 1), (counts, share)
    method = RowFeatures(labels)
    evaluate_epoch(config_of(), data, NO_SETS, StageInputs(), method, BareSession(), last=True)
    assert len(seen_in(method, data, "val")) == 300 == len(seen_in(method, data, "test"))
    with pytest.raises(ValidationError, match="max_eval_samples"):
        config_of(max_eval_samples=5)


def _two_ranks(rank: int, init_method: str, directory: str) -> None:
    """One rank of the two-rank test: the embedding pass alone, then a two-stage MCL
    evaluation with the clustering between the stages; what it holds goes to ``directory``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        session = BareSession(rank, 2)
        data, labels = row_data((301, 40, 40))
        method = RowFeatures(labels)
        gathered = embed_images(method, data.train.images, session, batch_size=64)
        config = config_of("mcl", max_eval_samples=30, linear_backend="torch")
        features, metrics, _ = evaluate_epoch(config, data, NO_SETS, StageInputs(), method,
                                              session, last=True)
        inputs = between_stages(config, StageInputs(), features, metrics, None, session,
                                Clock(time.time()))
        last_features, metrics, diagnostics = evaluate_epoch(
            config, data, NO_SETS, inputs, RowFeatures(labels, seed=1), session, last=True)
        arrays = {"assignment": inputs.assignments[0], "pseudo_labels": inputs.pseudo_labels}
        if gathered is not None:
            arrays["gathered"] = gathered
        np.savez(f"{directory}/rank{rank}.npz", **arrays)
        Path(f"{directory}/rank{rank}.json").write_text(json.dumps({
            "features": {key: len(values) for key, values in features.items()},
            "last_features": sorted(last_features),
            "inputs_features": [sorted(stage) for stage in inputs.features],
            "val_linear": metrics.get("val/linear/mean"),
            "diagnostics": sorted(diagnostics or {})}))
    finally:
        dist.destroy_process_group()


def test_only_rank0_holds_the_features_and_both_ranks_cluster_alike(tmp_path: Path) -> None:
    """Finding 1: on two gloo ranks the (N, D) features are gathered on rank 0 alone (exactly
    the single-process array, odd N: one rank's shard is shorter); rank 1's evaluation returns
    no features and its next stage's inputs carry none, while both ranks get the same k-means
    assignment and pseudo labels; rank 0 integrates and scores stage 1 and makes MCL's summary
    from every training row."""
    run_fake_world(_two_ranks, (f"file://{tmp_path}/rendezvous", str(tmp_path)), nprocs=2,
                   timeout=120)
    first, second = (np.load(tmp_path / f"rank{rank}.npz") for rank in range(2))
    held = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    _, labels = row_data((301, 40, 40))
    expected = RowFeatures(labels).features_of(torch.arange(301)).numpy()
    np.testing.assert_allclose(first["gathered"], expected, rtol=1e-6)
    assert "gathered" not in second.files
    assert held[0]["features"] == {"train": 301, "val": 30, "test": 30}
    assert held[1]["features"] == {} and held[1]["last_features"] == []
    assert held[0]["inputs_features"] == [["test", "train", "val"]]
    assert held[1]["inputs_features"] == [[]]
    np.testing.assert_array_equal(first["assignment"], second["assignment"])
    np.testing.assert_array_equal(first["pseudo_labels"], second["pseudo_labels"])
    assert len(first["assignment"]) == 301
    assert 0.0 <= held[0]["val_linear"] <= 1.0 and held[1]["val_linear"] is None
    assert "mcl_ami" in held[0]["diagnostics"] and held[1]["diagnostics"] == []


def test_the_papers_probe_reads_every_row_whatever_the_cheap_probes_caps(monkeypatch) -> None:
    """Issue 46, finding 3: with ``eval.max_train_samples``/``max_eval_samples`` set (the caps
    that keep the every-epoch probe cheap), the papers' protocol (``eval.linear_sgd``) still
    trains on every training row, selects on every val row and tests on every test row, while
    the closed-form probe scores the capped rows."""
    import raycl.worker.linear_eval as linear_eval

    reached: dict[str, int] = {}

    def record(encoder, train, val, load_test, num_classes, settings, device, seed, group=None):
        reached.update(train=len(train.images), val=len(val.images),
                       test=len(load_test().images))
        return {}

    monkeypatch.setattr(linear_eval, "evaluate_linear_sgd", record)
    data, labels = row_data((700, 100, 200))
    config = config_of(max_train_samples=100, max_eval_samples=50,
                       linear_sgd={"epochs": 1, "batch_size": 32})
    method = RowFeatures(labels)
    _, metrics, _ = evaluate_epoch(config, data, NO_SETS, StageInputs(), method, BareSession(),
                                   last=True)
    assert reached == {"train": 700, "val": 100, "test": 200}
    assert metrics["data/val_size"] == 50  # the closed-form probe: the capped rows
    assert len(seen_in(method, data, "train")) == 100  # only its rows embedded for it


def _scoring_outlasts_the_group_timeout(rank: int, init_method: str, directory: str) -> None:
    """One rank of the delayed-scoring test: the default group's timeout (2 s) stands for the
    NCCL watchdog, rank 0's scoring takes 5 s (a paper-scale split), then both ranks enter the
    next collective of the default group (the papers' probe, the next epoch's all_reduce)."""
    import raycl.worker.evaluate as evaluate

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2,
                            timeout=timedelta(seconds=2))
    try:
        if rank == 0:
            score = evaluate._score

            def slow_score(*args: Any) -> Any:
                time.sleep(5)
                return score(*args)

            evaluate._score = slow_score
        data, labels = row_data((200, 40, 40))
        _, metrics, _ = evaluate_epoch(config_of(), data, NO_SETS, StageInputs(),
                                       RowFeatures(labels), BareSession(rank, 2), last=True)
        total = torch.ones(1)
        dist.all_reduce(total)
        Path(directory, f"rank{rank}.json").write_text(json.dumps(
            {"total": total.item(), "val_linear": metrics.get("val/linear/mean")}))
    finally:
        dist.destroy_process_group()


def test_the_other_ranks_wait_for_rank0s_scoring_outside_the_groups_timeout(
        tmp_path: Path) -> None:
    """Issue 46, finding 1: rank 0 scores alone for longer than the default group's timeout;
    rank 1 waits in a barrier of its own instead of the next collective, so neither rank's
    group aborts and both go on (before the fix rank 1 died in that all_reduce)."""
    run_fake_world(_scoring_outlasts_the_group_timeout,
                   (f"file://{tmp_path}/rendezvous", str(tmp_path)), nprocs=2, timeout=120)
    held = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [rank["total"] for rank in held] == [2.0, 2.0]
    assert 0.0 <= held[0]["val_linear"] <= 1.0 and held[1]["val_linear"] is None


def _probe_on_rank0_alone(rank: int, init_method: str, directory: str) -> None:
    """One rank of the sub-group test: the papers' probe with a global batch of 16, which two
    ranks would split into 8 images each, below the probe's per-rank minimum."""
    from raycl.worker.linear_eval import linear_sgd_evaluation

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        data, labels = row_data((120, 40, 40))
        method = RowFeatures(labels)
        metrics = linear_sgd_evaluation(_probe_config(), data, method, BareSession(rank, 2))
        total = torch.ones(1)
        dist.all_reduce(total)  # both ranks go on together afterwards
        Path(directory, f"rank{rank}.json").write_text(json.dumps(
            {"metrics": metrics, "embedded": int(sum(len(rows) for rows in method.seen)),
             "total": total.item()}))
    finally:
        dist.destroy_process_group()


def _probe_config() -> Any:
    return config_of(linear_sgd={"epochs": 2, "batch_size": 16, "lrs": [0.1, 1.0],
                                 "augment": False})


def test_the_papers_probe_runs_on_as_many_ranks_as_its_batch_feeds(tmp_path: Path) -> None:
    """Issue 46, finding 8: the probe's global batch is shared by at most batch / 32 ranks
    (8 for the papers' 256, not 64 ranks of 4 images); here one rank of two runs it on a
    process group of its own, the other waits outside the default group and embeds nothing,
    and the scores are exactly one process's."""
    from raycl.worker.linear_eval import linear_sgd_evaluation, probe_ranks

    assert [probe_ranks(256, 64), probe_ranks(256, 4), probe_ranks(16, 8)] == [8, 4, 1]
    run_fake_world(_probe_on_rank0_alone, (f"file://{tmp_path}/rendezvous", str(tmp_path)),
                   nprocs=2, timeout=120)
    held = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    data, labels = row_data((120, 40, 40))
    alone = linear_sgd_evaluation(_probe_config(), data, RowFeatures(labels), BareSession())
    scores = {key: value for key, value in alone.items() if not key.startswith("perf/")}
    assert scores and "test/linear_sgd/mean" in scores
    assert {key: held[0]["metrics"][key] for key in scores} == pytest.approx(scores, abs=1e-6)
    assert held[0]["metrics"]["perf/linear_sgd_ranks"] == 1.0
    assert held[0]["embedded"] > 0 and held[1]["embedded"] == 0
    assert not any(key.startswith(("val/", "test/")) for key in held[1]["metrics"])
    assert [rank["total"] for rank in held] == [2.0, 2.0]
