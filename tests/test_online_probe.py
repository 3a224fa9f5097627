"""The online probe (``eval.online_probe``, raycl.worker.online_probe): heads trained beside the
method on detached backbone features, their gradients averaged over two gloo ranks, their state
checkpointed, and a trial that reports both of its families."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import yaml
from fake_world import run_fake_world
from faults import injected_fault
from test_config import error_of
from test_reliability import StoredSession
from torch import nn

from raycl.methods import SearchConfig
from raycl.worker.context import TrialContext
from raycl.worker.loop import run_trial_loop
from raycl.worker.online_probe import OnlineProbe

LABELS = {"shape": np.array([0, 1, 2, 0, 1, 2, 0, 1]), "color": np.array([1, 1, 0, 0, 1, 1, 0, 0])}
CLASSES = {"shape": 3, "color": 2}


def _probe(backbone: nn.Module, lr: float = 0.1) -> OnlineProbe:
    return OnlineProbe(backbone, LABELS, CLASSES, lr, torch.device("cpu"))


def test_heads_learn_from_detached_features_and_the_backbone_gets_nothing() -> None:
    """The heads read what the backbone output in the training forward (both views, each row
    labelled), never what it outputs elsewhere; the encoder's gradients are the method's alone;
    the running accuracy counts every view; a checkpoint's state gives the same heads back."""
    torch.manual_seed(0)
    backbone = nn.Linear(4, 5)
    probe = _probe(backbone)
    images, index = torch.randn(4, 4), torch.tensor([0, 1, 2, 7])
    backbone(images)  # an evaluation's forward: not captured
    with probe.capturing():
        features = torch.cat([backbone(images), backbone(images + 0.1)])  # two views
    features.pow(2).sum().backward()  # the method's own loss
    method_grad = backbone.weight.grad.clone()
    probe.step(index)
    assert torch.equal(backbone.weight.grad, method_grad)  # nothing from the probe
    assert probe.heads is not None and set(probe.heads) == {"shape", "color"}
    assert probe.heads["shape"].weight.abs().sum() > 0  # moved from its zeros
    assert probe._seen.item() == 8  # 4 rows x 2 views

    metrics = probe.pop_metrics()
    assert set(metrics) == {"train/online_linear/shape", "train/online_linear/color",
                            "train/online_linear/mean"}
    assert all(0.0 <= value <= 1.0 for value in metrics.values())
    assert probe.pop_metrics() == {}  # the counts were reset: nothing seen since

    scored = probe.score("val", np.random.default_rng(0).standard_normal((6, 5)),
                         {name: values[:6] for name, values in LABELS.items()})
    assert set(scored) == {"val/online_linear/shape", "val/online_linear/color",
                           "val/online_linear/mean"}
    restored = _probe(nn.Linear(4, 5))
    restored.load_state_dict(probe.state_dict())
    assert restored.heads is not None
    assert torch.equal(restored.heads["shape"].weight, probe.heads["shape"].weight)
    assert restored.score("val", np.ones((2, 5)), {k: v[:2] for k, v in LABELS.items()}) == \
        probe.score("val", np.ones((2, 5)), {k: v[:2] for k, v in LABELS.items()})


def test_rows_beyond_the_labelled_ones_and_other_calls_are_not_probed() -> None:
    """Pretraining-only rows (an index past the training split) carry no label; a backbone call
    that is not over the batch's rows (a support set, a decoder's input) is left out."""
    backbone = nn.Linear(4, 5)
    probe = _probe(backbone)
    with probe.capturing():
        backbone(torch.randn(2, 4))
        backbone(torch.randn(3, 4))  # not the batch's rows
    probe.step(torch.tensor([6, 8]))  # row 8 is past the 8 labelled rows
    assert probe._seen.item() == 1


def _averaging_worker(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(rank)  # different features and rows on each rank
    backbone = nn.Linear(4, 5)
    probe = _probe(backbone, lr=0.1)
    images = torch.randn(3, 4)
    index = torch.tensor([[0, 1, 2], [3, 4, 5]][rank])
    with probe.capturing():
        features = backbone(images)
    # This rank's own gradient, as a single process would compute it (the heads start at 0).
    local = {}
    for name, classes in CLASSES.items():
        head = nn.Linear(5, classes)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        nn.functional.cross_entropy(head(features.detach()),
                                    torch.as_tensor(LABELS[name][index.numpy()])).backward()
        local[name] = head.weight.grad.tolist()
    probe.step(index)
    assert probe.heads is not None
    averaged = {name: head.weight.grad.tolist() for name, head in probe.heads.items()}
    weights = {name: head.weight.tolist() for name, head in probe.heads.items()}
    metrics = probe.pop_metrics()
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "local": local, "averaged": averaged, "weights": weights, "metrics": metrics,
        "backbone_grad": backbone.weight.grad is None}))
    dist.destroy_process_group()


def test_two_ranks_average_the_heads_gradients_and_step_alike(tmp_path: Path) -> None:
    """Data-parallel like the method: each rank's heads step on the mean of both ranks'
    gradients, so the heads stay identical; the running accuracy counts both ranks' rows; the
    backbone gets no gradient."""
    run_fake_world(_averaging_worker, (f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), 2)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for name in CLASSES:
        expected = (np.array(ranks[0]["local"][name]) + np.array(ranks[1]["local"][name])) / 2
        for rank in ranks:
            np.testing.assert_allclose(rank["averaged"][name], expected, rtol=1e-5, atol=1e-7)
        assert ranks[0]["weights"][name] == ranks[1]["weights"][name]
    assert ranks[0]["metrics"] == ranks[1]["metrics"]
    assert all(rank["backbone_grad"] for rank in ranks)  # None: no gradient reached it


TINY = {"name": "online", "method": "simclr", "seed": 0,
        "data": {"dataset": "trifeature", "samples_per_combination": 1, "resolution": 16},
        "model": {"width": 8, "projector_hidden_dim": 32, "projector_dim": 16},
        "train": {"epochs": 3, "batch_size": 64, "checkpoint_every": 1},
        "eval": {"every_n_epochs": 1, "linear_max_iter": 50, "online_probe": True,
                 "diagnostics": False},
        "scaling": {"num_workers": 0}}


def test_a_trial_reports_both_probe_families_and_resumes_with_its_heads(
        data_cache: Path, tmp_path: Path, one_torch_thread: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every epoch its running accuracy, every evaluation the heads on val (test at the end),
    beside (never instead of) the closed-form probe; each checkpoint holds the heads, and a
    trial resumed after a crash starts its heads from them."""
    config = SearchConfig.model_validate(TINY)
    crashed = StoredSession(tmp_path / "run")
    with injected_fault(after_epoch=2, marker=tmp_path / "crashed"), \
            pytest.raises(RuntimeError, match="injected fault"):
        run_trial_loop(TrialContext(config=config), crashed)
    assert [report["epoch"] for report in crashed.reports] == [1, 2]
    for report in crashed.reports:
        for family in ("train/online_linear", "val/online_linear"):
            for attribute in ("shape", "texture", "color", "mean"):
                assert 0.0 <= report[f"{family}/{attribute}"] <= 1.0
        assert "val/linear/mean" in report
    last = sorted((tmp_path / "run").glob("checkpoint_*"))[-1]
    heads = torch.load(last / "state.pt", weights_only=True)["online_probe"]["heads"]
    assert set(heads) == {f"{name}.{part}" for name in ("shape", "texture", "color")
                          for part in ("weight", "bias")}

    loaded: list[dict] = []
    original = OnlineProbe.load_state_dict

    def spy(self: OnlineProbe, state: dict) -> None:
        loaded.append(state)
        original(self, state)

    monkeypatch.setattr(OnlineProbe, "load_state_dict", spy)
    resumed = StoredSession(tmp_path / "run")
    run_trial_loop(TrialContext(config=config), resumed)
    assert [report["epoch"] for report in resumed.reports] == [3]
    (state,) = loaded
    assert torch.equal(state["heads"]["shape.weight"], heads["shape.weight"])
    assert "test/online_linear/mean" in resumed.reports[-1]


@pytest.mark.parametrize(("changes", "expected"), [
    ({"eval": {"online_probe": False}, "tune": {"metric": "val/online_linear/mean"}},
     "tune.metric: val/online_linear/mean is reported only with eval.online_probe: true"),
    ({"method": "mcl"}, "eval.online_probe: not yet for MCL"),
    ({"tune": {"metric": "val/online_linear/size"}},
     "tune.metric: trifeature has no attribute 'size'"),
])
def test_the_online_probe_is_checked_before_launch(
        tmp_path: Path, changes: dict, expected: str) -> None:
    raw = {**TINY, **{key: {**TINY.get(key, {}), **value} if isinstance(value, dict) else value
                      for key, value in changes.items()}}
    assert expected in error_of(tmp_path, yaml.safe_dump(raw))
