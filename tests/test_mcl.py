"""MCL's pieces that the pipeline glues together: stage hand-over, negatives, integration."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from raycl.kmeans import ami_matrix
from raycl.losses import nt_xent, same_label_mask
from raycl.methods import SearchConfig
from raycl.trial.trainable import log_trial_figures
from raycl.worker.samplers import PseudoLabelBatchSampler
from raycl.worker.stage_integration import (
    MCL_AMI,
    MCL_GROUP_SIZES,
    StageInputs,
    integrate,
    mcl_summary,
    next_stage_inputs,
)


def blobs(centres: np.ndarray, per_centre: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([c + 0.01 * rng.standard_normal((per_centre, len(c)))
                           for c in centres]).astype(np.float32)


def test_next_stage_inputs_encodes_every_stage() -> None:
    config = SearchConfig.model_validate({"name": "m", "method": "mcl",
                                          "mcl": {"clusters": 2, "stages": 3}})
    # Stage 0 separates the first 40 samples from the last 40; stage 1 alternates in tens.
    directions = np.eye(4, dtype=np.float32)
    stage0 = blobs(directions[[0, 1]], 40, seed=0)
    stage1 = np.concatenate([blobs(directions[[2, 3, 2, 3]], 10, seed=s) for s in (1, 2)])
    inputs = next_stage_inputs(config, StageInputs(), {"train": stage0, "val": stage0[:5]})
    assert inputs.stage == 1 and len(np.unique(inputs.pseudo_labels)) == 2
    inputs = next_stage_inputs(config, inputs, {"train": stage1, "val": stage1[:5]})
    assert inputs.stage == 2 and len(inputs.features) == 2
    # Four groups = every (stage-0, stage-1) combination, 20 samples each. Encoding only the
    # latest stage (the authors' slip) would give two groups of 40.
    _, sizes = np.unique(inputs.pseudo_labels, return_counts=True)
    assert sorted(sizes) == [20, 20, 20, 20]
    y0, y1 = inputs.assignments
    np.testing.assert_array_equal(inputs.pseudo_labels, y0 * 2 + y1)


def test_the_ami_figure_is_drawn_from_the_workers_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the last stage the worker clusters it and hands on small arrays (never features);
    the trial process logs the same AMI, group sizes and figure from them, clustering nothing."""
    config = SearchConfig.model_validate({"name": "m", "method": "mcl",
                                          "data": {"dataset": "digits"},
                                          "mcl": {"clusters": 2, "stages": 2}})
    directions = np.eye(4, dtype=np.float32)
    stage0 = blobs(directions[[0, 1]], 40, seed=0)
    stage1 = np.concatenate([blobs(directions[[2, 3, 2, 3]], 10, seed=s) for s in (1, 2)])
    inputs = next_stage_inputs(config, StageInputs(), {"train": stage0},
                               {"stage0/test/linear/digit": 0.7, "stage0/val/knn/digit": 0.1})
    metrics = {"stage1/test/linear/digit": 0.8, "test/linear/digit": 0.9, "train/loss": 1.0}
    arrays = mcl_summary(config, inputs, {"train": stage1, "val": stage1[:5]}, metrics)
    # What the trial process computed before from the features: the next stage's clustering.
    final = next_stage_inputs(config, inputs, {"train": stage1}, metrics)
    np.testing.assert_allclose(arrays[MCL_AMI], ami_matrix(final.assignments))
    assert arrays[MCL_AMI][0, 0] == pytest.approx(1.0) and arrays[MCL_AMI][0, 1] < 0.1
    np.testing.assert_array_equal(arrays[MCL_GROUP_SIZES], [40, 40])
    assert sum(values.nbytes for values in arrays.values()) < 1000

    logged: list[tuple[dict[str, float], set[str]]] = []

    def log(config: Any, trial_id: str, metrics: dict[str, float], directory: Path) -> None:
        logged.append((metrics, {path.name for path in directory.iterdir()
                                 if path.stat().st_size > 0}))
        if (directory / "ami_matrix.json").exists():
            assert json.loads((directory / "ami_matrix.json").read_text())[1][1] == 1.0

    monkeypatch.setattr("raycl.tracking.relay.log_to_trial_run", log)
    np.savez(tmp_path / "diagnostics.npz", **arrays)  # as the last checkpoint carries them
    log_trial_figures(config, tmp_path / "diagnostics.npz")
    assert len(logged) == 1  # eval.diagnostics off: no spectrum, the MCL summary alone
    ami_metrics, files = logged[0]
    assert ami_metrics["mcl/ami/stage0_stage1"] == pytest.approx(float(arrays[MCL_AMI][0, 1]))
    assert (ami_metrics["mcl/groups"], ami_metrics["mcl/group_size_min"]) == (2.0, 40.0)
    assert files == {"ami_matrix.json", "group_sizes.txt", "mcl_diagnostics.png"}


def test_stage_inputs_round_trip(tmp_path) -> None:
    rng = np.random.default_rng(0)
    inputs = StageInputs(stage=2, pseudo_labels=np.arange(6) % 3,
                         features=[{"train": rng.random((6, 4)), "val": rng.random((3, 4)),
                                    "test": rng.random((2, 4))} for _ in range(2)],
                         assignments=[np.arange(6) % 2, np.arange(6) % 3],
                         stage_metrics=[{"stage0/val/linear/mean": 0.5}, {}])
    inputs.save(tmp_path / "s.npz")
    loaded = StageInputs.load(tmp_path / "s.npz")
    assert loaded.stage == 2 and loaded.stage_metrics == inputs.stage_metrics
    np.testing.assert_array_equal(loaded.pseudo_labels, inputs.pseudo_labels)
    for a, b in zip(loaded.assignments, inputs.assignments, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(loaded.features, inputs.features, strict=True):
        assert sorted(a) == ["test", "train", "val"]
        for split in a:
            np.testing.assert_array_equal(a[split], b[split])
    # The integration covers exactly the splits the current stage brings.
    joint = loaded.integrated({"train": rng.random((6, 4)), "val": rng.random((3, 4))})
    assert sorted(joint) == ["train", "val"] and joint["train"].shape == (6, 12)


def test_integration_weights_stages_equally() -> None:
    big = np.array([[100.0, 0.0], [0.0, 100.0]])
    small = np.array([[0.01, 0.0], [0.0, 0.01]])
    joint = integrate([big, small])
    np.testing.assert_allclose(np.linalg.norm(joint, axis=1), 1.0)
    # Each stage contributes half of the squared norm however large its raw features are.
    np.testing.assert_allclose((joint[:, :2] ** 2).sum(1), 0.5)
    np.testing.assert_array_equal(integrate([big]), big)


@pytest.mark.parametrize("world", [1, 2])
def test_sampler_and_mask_give_each_anchor_the_same_negatives(world: int) -> None:
    """Sampler mode: a pure batch, so the loss with the same-label mask equals the plain loss.
    Mask mode: any batch, the mask leaves exactly the same-label batch-mates as negatives."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, size=200)
    samplers = [PseudoLabelBatchSampler(labels, 16, num_replicas=world, rank=r, seed=1)
                for r in range(world)]
    global_batches = samplers[0].global_batches()
    pure = [b for b in global_batches if len(np.unique(labels[b])) == 1]
    assert pure and len(pure) > len(global_batches) // 2
    z1, z2 = torch.randn(16, 8), torch.randn(16, 8)
    for batch in pure[:3]:
        batch_labels = torch.as_tensor(labels[batch])
        mask = same_label_mask(batch_labels, batch_labels)
        assert bool(mask.all())
        torch.testing.assert_close(nt_xent(z1, z2, 0.5, mask), nt_xent(z1, z2, 0.5))
    # Mask mode on a mixed batch: anchor i's loss equals the plain loss within its own group.
    mixed_labels = torch.as_tensor(labels[:16])
    masked = nt_xent(z1, z2, 0.5, same_label_mask(mixed_labels, mixed_labels))
    per_group = []
    for value in mixed_labels.unique():
        members = (mixed_labels == value).nonzero().squeeze(1)
        per_group.append(nt_xent(z1[members], z2[members], 0.5) * len(members))
    torch.testing.assert_close(masked, torch.stack(per_group).sum() / 16)
