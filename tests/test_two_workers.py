"""Every method trains a real two-worker trial (gloo, CPU) to its end: a collective entered by
one rank only, or any other rank-asymmetric path, fails here within a minute instead of hanging
a GPU cluster. Plus the rank-0 guard: a collective inside a rank-0-only section raises at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
from two_workers import RankResult, WorkerPair

from raycl.data import load_dataset
from raycl.distributed import (
    CollectiveInSingleRankSection,
    all_reduce_mean,
    all_reduce_sum,
    any_rank,
    barrier_after,
    broadcast_from_rank0,
    gather_no_grad,
    gather_to_rank0,
    gather_with_grad,
    single_rank_section,
)
from raycl.methods import SearchConfig, build_method
from raycl.worker.evaluate import method_diagnostics

TINY: dict[str, Any] = {
    "name": "two-workers",
    "data": {"samples_per_combination": 1, "resolution": 16},
    "model": {"width": 8, "projector_hidden_dim": 32, "projector_dim": 16},
    "train": {"epochs": 1, "batch_size": 64, "lr": 0.002},
    "eval": {"every_n_epochs": 0, "linear_max_iter": 20, "knn_k": 5},
    "scaling": {"num_workers": 2, "cpus_per_worker": 1},
}
CAPTIONS = {"color": 1.0, "shape": 0.5, "texture": 0.5}
MCL = {"base": "simclr", "stages": 2, "clusters": 2, "kmeans_iterations": 10}
# Each trial's method and its tiny settings (small queues and heads): every method, and MCL's
# two ways of restricting negatives (pseudo-label batches; a mask over a gathered batch, with
# the model soup, which every rank embeds).
TRIALS: dict[str, dict[str, Any]] = {
    # With the papers' SGD linear evaluation at its end (each rank takes half of each batch).
    "simclr": {"eval": {"linear_sgd": {"epochs": 1, "batch_size": 64, "lrs": [0.1, 1.0]}}},
    "mocov2": {"mocov2": {"queue_size": 128}},
    "simsiam": {"simsiam": {"predictor_hidden_dim": 16}},
    "spectral": {},
    # With the online probe (its heads step on gradients averaged over both ranks).
    "hscl": {"eval": {"online_probe": True}},
    "nnclr": {"nnclr": {"queue_size": 256, "predictor_hidden_dim": 32}},
    "all4one": {"all4one": {"queue_size": 256, "predictor_hidden_dim": 32,
                            "transformer_heads": 2, "transformer_layers": 1,
                            "transformer_feedforward": 32}},
    "fgvr": {"fgvr": {"memory_size": 64, "decoder_epochs": 1, "decoder_width": 8},
             "mocov2": {"queue_size": 128}},
    "clip": {"data": {"captions": CAPTIONS},
             "clip": {"model": "tiny", "tiny_width": 32, "tiny_layers": 2,
                      "tiny_text_layers": 1, "trainable_blocks": 1, "tiny_embed_dim": 16,
                      "tiny_context_length": 12},
             "eval": {"mmvp": "synthetic", "mmvp_pairs": 4}},
    "mcl": {"mcl": {**MCL, "negatives": "sampler"}},
    "mcl_mask_soup": {"method": "mcl",
                      "mcl": {**MCL, "negatives": "mask", "integration": "soup"}},
    # A timm ViT (one block, 4 px patches): no BatchNorm in the encoder, attention's gradients
    # averaged over both ranks like any other.
    "nnclr_vit": {"method": "nnclr", "nnclr": {"queue_size": 256, "predictor_hidden_dim": 32},
                  "model": {"backbone": "timm/vit_tiny_patch16_224",
                            "timm_kwargs": {"img_size": 16, "patch_size": 4, "depth": 1,
                                            "embed_dim": 32, "num_heads": 2}}},
}


def trial_config(trial: str) -> dict[str, Any]:
    """The tiny two-worker trial ``trial`` (see TRIALS) as the worker loop receives it."""
    raw: dict[str, Any] = {key: dict(value) if isinstance(value, dict) else value
                           for key, value in TINY.items()}
    raw["method"] = trial
    for key, value in TRIALS[trial].items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return SearchConfig.model_validate(raw).to_dict()


@pytest.fixture(scope="module")
def worker_pair(data_cache) -> Iterator[WorkerPair]:
    """Two gloo ranks shared by this module's trials (started after data_cache: they inherit
    RAYCL_CACHE)."""
    pair = WorkerPair()
    yield pair
    pair.stop()


@pytest.mark.xdist_group("two-workers")  # one xdist worker, so one pair serves every trial
@pytest.mark.parametrize("trial", sorted(TRIALS))
def test_every_method_finishes_a_two_worker_trial(trial: str, worker_pair: WorkerPair) -> None:
    """Both ranks finish, see world size 2 and report the same epochs; rank 0 reports a finite
    loss, the evaluation (MMVP pairs for CLIP) and the end-of-trial diagnostics, among them
    FGVR's pictures (whose Grad-CAM hung the trial before)."""
    config = trial_config(trial)
    method = config["method"]
    first, second = worker_pair.run(config)
    assert [(r.rank, r.world_size) for r in (first, second)] == [(0, 2), (1, 2)]

    def epochs(result: RankResult) -> list[tuple[Any, ...]]:
        return [(r["stage"], r.get("phase"), r["epoch"]) for r in result.reports]

    assert epochs(first) == epochs(second) and epochs(first), method
    stages = config["mcl"]["stages"] if method == "mcl" else 1
    assert {report["stage"] for report in first.reports} == set(range(stages))
    final = first.final
    assert math.isfinite(final["train/loss"])
    objective = "val/mmvp/mean" if method == "clip" else "val/linear/mean"
    assert math.isfinite(final[objective]), sorted(final)
    assert "diag/effective_rank" in final
    if method == "fgvr":
        assert {"fgvr_triples", "fgvr_gradcam_scores"} <= set(first.diagnostics)
    # model.sync_batchnorm (default on): every BatchNorm layer normalises over the global batch
    # (converted before DDP wraps the model) on gloo ranks too.
    if method != "clip":  # its tiny ViT has no BatchNorm
        assert first.batchnorm_layers == second.batchnorm_layers == {"GlobalBatchNorm"}
    if config["eval"]["online_probe"]:  # counted over both ranks: the same on each
        assert first.final["train/online_linear/mean"] == \
            second.final["train/online_linear/mean"]
        assert 0.0 <= final["val/online_linear/mean"] <= 1.0
    if config["eval"]["linear_sgd"] is not None:  # the same heads, hence scores, on both ranks
        scores = {key: value for key, value in final.items()
                  if "linear_sgd" in key and not key.startswith("perf/")}
        assert {"val/linear_sgd/mean", "test/linear_sgd/shape", "diag/linear_sgd_lr/color"} \
            <= set(scores)
        assert scores == {key: second.final[key] for key in scores}


COLLECTIVES = {
    "gather_with_grad": lambda t: gather_with_grad(t),
    "gather_no_grad": lambda t: gather_no_grad(t),
    "all_reduce_mean": lambda t: all_reduce_mean(t),
    "all_reduce_sum": lambda t: all_reduce_sum(t),
    "broadcast_from_rank0": lambda t: broadcast_from_rank0(t),
    "any_rank": lambda t: any_rank(True),
    "gather_to_rank0": lambda t: gather_to_rank0(t),
    "barrier_after": lambda t: _wait_for_all(),
}


def _wait_for_all() -> None:
    """:func:`barrier_after` around an empty body (what the data loading waits in)."""
    with barrier_after(timedelta(seconds=5)):
        pass


@pytest.mark.parametrize("name", sorted(COLLECTIVES))
def test_every_collective_raises_inside_a_rank0_section(name: str) -> None:
    """Even in one process (where each is a no-op), so a single-worker test catches what would
    hang two workers; outside the section they work as before."""
    tensor = torch.ones(2, 3)
    with single_rank_section("a test's rank-0 block"), \
            pytest.raises(CollectiveInSingleRankSection, match="a test's rank-0 block"):
        COLLECTIVES[name](tensor)
    COLLECTIVES[name](tensor)


def test_fgvr_diagnostics_enter_no_collective(data_cache) -> None:
    """FGVR's Grad-CAM in its end-of-trial pictures ran a gathering loss that only rank 0
    entered (the two-worker trial hung): inside the rank-0 guard it must not gather."""
    config = SearchConfig.model_validate({**TINY, "method": "fgvr", **TRIALS["fgvr"],
                                          "scaling": {"num_workers": 0}})
    data = load_dataset(config.data, config.seed)
    torch.manual_seed(0)
    method = build_method(config, data.channels)
    with single_rank_section("the end-of-trial diagnostics"):
        arrays = method_diagnostics(config, data, method, torch.device("cpu"))
    scores = arrays["fgvr_gradcam_scores"]
    assert scores.shape[0] == len(arrays["fgvr_triples"])
    assert np.all((scores >= 0) & (scores <= 1))
