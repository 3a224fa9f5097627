"""NNCLR and All4One: the support-set queue, the All4One objective and its knobs.

Tiny sizes throughout (small_cnn width 8, 16x16 greyscale images, 16-d projections, queues of 30
entries), so the whole file runs in seconds on a CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from test_config import error_of, write  # one-line ConfigError of a YAML in tmp_path
from torch import Tensor

from raycl.config.schema import CoreConfig
from raycl.config.search_config import CONFIG_KEYS, schema_markdown, search_config_class
from raycl.data import DatasetSplits, ImageSet
from raycl.eval.support_retrieval import neighbour_retrieval_accuracy
from raycl.launch.load import load_search
from raycl.losses import info_nce, redundancy_reduction_loss, sinusoidal_positional_encoding
from raycl.methods import METHODS, Batch, build_method
from raycl.methods.all4one import All4One, CentroidEncoder, centroid_positions, shift
from raycl.methods.nnclr import NNCLR
from raycl.methods.queues import FeatureQueue
from raycl.methods.simclr import SimCLR
from raycl.models.momentum import momentum_coefficient
from raycl.tune import main
from raycl.worker.optim import build_optimizer

MODEL = {"backbone": "small_cnn", "width": 8, "projector_hidden_dim": 32, "projector_dim": 16}
SECTIONS: dict[str, dict[str, Any]] = {
    "nnclr": {"queue_size": 30, "predictor_hidden_dim": 32},
    "all4one": {"queue_size": 30, "predictor_hidden_dim": 32, "neighbours": 3,
                "transformer_layers": 1, "transformer_heads": 2, "transformer_feedforward": 32,
                "transformer_dropout": 0.0},
}
NUM_SAMPLES, BATCH = 12, 6  # two batches per epoch: every sample comes back every other step
DATASET = torch.randn(NUM_SAMPLES, 1, 16, 16, generator=torch.Generator().manual_seed(123))


# One intra-op thread for these tiny models (see conftest.one_torch_thread).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_cfg(method: str, section: dict[str, Any] | None = None, **core: Any) -> CoreConfig:
    """A validated config for ``method`` with tiny model sizes; ``section`` overrides knobs."""
    raw: dict[str, Any] = {"name": "x", "method": method, "model": MODEL, **core}
    if method in SECTIONS:
        raw[method] = {**SECTIONS[method], **(section or {})}
    return search_config_class().model_validate(raw)


def build(method: str, seed: int = 0, cls: type[NNCLR] | None = None, **section: Any) -> NNCLR:
    """``method`` (or the subclass ``cls``) built from its config section, seeded."""
    torch.manual_seed(seed)
    built = (cls or METHODS[method]).from_config(make_cfg(method, section), in_channels=1)
    assert isinstance(built, NNCLR)
    return built


def make_batch(step: int = 0, noise: float = 0.05) -> Batch:
    """Batch ``step`` of the 12-sample dataset: samples 0-5 on even steps, 6-11 on odd ones;
    the two views are the images plus fresh noise each step."""
    generator = torch.Generator().manual_seed(1000 + step)
    index = torch.arange(BATCH) + BATCH * (step % 2)
    images = DATASET[index]
    views = [images + noise * torch.randn(images.shape, generator=generator) for _ in range(2)]
    return Batch(images=images, views=views, index=index)


def weights(method: All4One) -> tuple[float, float, float]:
    """(σ, κ, η) of the objective."""
    return method.section.sigma, method.section.kappa, method.section.eta


def trainable(method: NNCLR) -> list[torch.nn.Parameter]:
    return [param for param in method.parameters() if param.requires_grad]


@torch.no_grad()
def drift(method: NNCLR, scale: float = 0.05) -> None:
    """Moves the online networks away from the momentum copies (as optimizer steps would), so
    that online and momentum projections differ."""
    generator = torch.Generator().manual_seed(7)
    for param in trainable(method):
        param.add_(scale * torch.randn(param.shape, generator=generator))


def nearest_rows(snapshot: Tensor, queries: Tensor, k: int) -> Tensor:
    """(B, k, D): the k snapshot rows most cosine-similar to each query, nearest first."""
    return snapshot[(F.normalize(queries, dim=1) @ snapshot.T).topk(k, dim=1).indices]


# ---------------------------------------------------------------- never its own neighbour


@dataclass
class StepRecord:
    """What one training step did to the queue."""

    batch_index: Tensor
    snapshot: Tensor  # (Q, D) queue entries before the step
    snapshot_index: Tensor  # (Q,) their sample indices
    events: list[str] = field(default_factory=list)  # "nearest" / "enqueue", in call order
    neighbours: list[Tensor] = field(default_factory=list)  # (B, k, D) per lookup
    retrieved: list[Tensor] = field(default_factory=list)  # (B, k) sample indices per lookup
    written: list[Tensor] = field(default_factory=list)  # queue positions per enqueue
    enqueued: list[Tensor] = field(default_factory=list)  # sample indices per enqueue


class QueueSpy:
    """Wraps ``queue.nearest`` and ``queue.enqueue`` of one instance and records each step."""

    def __init__(self, queue: FeatureQueue, monkeypatch: pytest.MonkeyPatch) -> None:
        self.queue = queue
        self.steps: list[StepRecord] = []
        nearest, enqueue = queue.nearest, queue.enqueue

        def spy_nearest(queries: Tensor, k: int) -> tuple[Tensor, Tensor]:
            neighbours, sample_index = nearest(queries, k)
            record = self.steps[-1]
            record.events.append("nearest")
            record.neighbours.append(neighbours.clone())
            record.retrieved.append(sample_index.clone())
            return neighbours, sample_index

        def spy_enqueue(embeddings: Tensor, sample_index: Tensor) -> None:
            before = int(queue.pointer)
            enqueue(embeddings, sample_index)
            count = min(len(sample_index), queue.size)
            assert int(queue.pointer) == (before + count) % queue.size
            record = self.steps[-1]
            record.events.append("enqueue")
            record.written.append((before + torch.arange(count)) % queue.size)
            record.enqueued.append(sample_index.clone())

        monkeypatch.setattr(queue, "nearest", spy_nearest)
        monkeypatch.setattr(queue, "enqueue", spy_enqueue)

    def start_step(self, batch: Batch) -> None:
        self.steps.append(StepRecord(batch.index.clone(), self.queue.embeddings.clone(),
                                     self.queue.sample_index.clone()))

    def violations(self) -> list[str]:
        """Ways the last step let a sample meet an entry written in that same step."""
        record, found = self.steps[-1], []
        first_enqueue = (record.events.index("enqueue") if "enqueue" in record.events
                         else len(record.events))
        if "nearest" in record.events[first_enqueue:]:
            found.append(f"lookup after an enqueue: {record.events}")
        # Entries the step wrote, read back at the positions it wrote them to.
        written = torch.cat([self.queue.embeddings[positions] for positions in record.written])
        for neighbours, retrieved in zip(record.neighbours, record.retrieved, strict=True):
            same_row = (neighbours[:, :, None] == record.snapshot[None, None]).all(-1)
            in_snapshot = (same_row & (retrieved[:, :, None] == record.snapshot_index)).any(-1)
            if not in_snapshot.all():
                found.append(f"{int((~in_snapshot).sum())} neighbours not in the queue before "
                             f"the step")
            if (neighbours[:, :, None] == written[None, None]).all(-1).any():
                found.append("a neighbour is an entry written in this step")
        return found


def run_steps(method: NNCLR, spy: QueueSpy, steps: int) -> list[list[str]]:
    """``steps`` SGD steps on the repeating batches; the violations of each step."""
    optimizer = torch.optim.SGD(trainable(method), lr=0.05)
    violations = []
    for step in range(steps):
        batch = make_batch(step)
        spy.start_step(batch)
        loss = method(batch)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        method.on_train_step_end(step + 1, steps)
        violations.append(spy.violations())
    return violations


class EnqueueFirstNNCLR(NNCLR):
    """The bug the ordering prevents: view 1's projections enqueued before the lookups."""

    def forward(self, batch: Batch) -> dict[str, Tensor]:
        z1 = self.project(torch.cat(batch.views)).chunk(2)[0]
        self.queue.enqueue(z1, batch.index)
        return super().forward(batch)


class EnqueueFirstAll4One(All4One):
    """The same bug in All4One: view 1's momentum projections enqueued before the lookups."""

    def forward(self, batch: Batch) -> dict[str, Tensor]:
        target1 = self.momentum_project(torch.cat(batch.views)).chunk(2)[0]
        self.queue.enqueue(target1, batch.index)
        return super().forward(batch)


@pytest.mark.parametrize("name", ["nnclr", "all4one"])
def test_a_sample_is_never_its_own_neighbour(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lookups come before the enqueue and return only entries of earlier steps, although older
    copies of the same samples are in the queue and are retrieved."""
    method = build(name, symmetric=True)
    spy = QueueSpy(method.queue, monkeypatch)
    steps = 8  # 48 writes into 30 entries: the queue wraps around
    assert run_steps(method, spy, steps) == [[]] * steps

    for record in spy.steps:
        assert record.events == ["nearest", "nearest", "enqueue"]
        assert torch.equal(record.enqueued[0], record.batch_index)
    # The scenario has teeth: from step 2 on, a sample's older copy is in the queue, and lookups
    # do find entries of the very samples in the batch (by sample index, not by entry).
    own_index_hits = sum(int((retrieved == record.batch_index[:, None]).any(1).sum())
                         for record in spy.steps[2:] for retrieved in record.retrieved)
    assert own_index_hits > 0
    assert int(method.queue.pointer) == steps * BATCH % 30


@pytest.mark.parametrize(("name", "cls"), [("nnclr", EnqueueFirstNNCLR),
                                           ("all4one", EnqueueFirstAll4One)])
def test_enqueue_before_lookup_is_caught(
    name: str, cls: type[NNCLR], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checks above fail for a forward that enqueues first: every sample then retrieves its
    own current entry."""
    method = build(name, cls=cls, symmetric=True)
    spy = QueueSpy(method.queue, monkeypatch)
    violations = run_steps(method, spy, 3)
    for found in violations:
        assert any("lookup after an enqueue" in problem for problem in found)
        assert any("not in the queue before the step" in problem for problem in found)
        assert any("written in this step" in problem for problem in found)
    for record in spy.steps:
        nearest_to_view1 = record.retrieved[0][:, 0]
        assert torch.equal(nearest_to_view1, record.batch_index)  # its own entry


# ---------------------------------------------------------------- All4One objective


def test_all4one_forward_backward_and_weights() -> None:
    """Loss = σ·neighbour + κ·centroid + η·redundancy; gradients reach every trainable part and
    never the momentum branch."""
    method = build("all4one", sigma=0.3, kappa=0.7, eta=2.0)
    assert weights(method) == (0.3, 0.7, 2.0)
    drift(method)
    first = make_batch(0)
    method(first)  # fill part of the queue first ...
    with torch.no_grad():  # ... with view 1's momentum projections, normalised
        views = torch.cat(first.views)
        target1, online1 = method.momentum_project(views)[:BATCH], method.project(views)[:BATCH]
    torch.testing.assert_close(method.queue.embeddings[:BATCH], F.normalize(target1, dim=1))
    assert not torch.allclose(method.queue.embeddings[:BATCH], F.normalize(online1, dim=1))
    assert torch.equal(method.queue.sample_index[:BATCH], first.index)
    outputs = method(make_batch(1))
    assert set(outputs) == {"loss", "neighbour_loss", "centroid_loss", "redundancy_loss",
                            "pos_sim", "queue_fill"}
    assert torch.isfinite(outputs["loss"]) and outputs["loss"].dim() == 0
    for key in ("neighbour_loss", "centroid_loss", "redundancy_loss", "pos_sim"):
        assert not outputs[key].requires_grad, key
    assert outputs["queue_fill"].item() == pytest.approx(12 / 30)
    parts = [outputs[key].item() for key in ("neighbour_loss", "centroid_loss",
                                             "redundancy_loss")]
    assert len({round(part, 4) for part in parts}) == 3  # a swapped weight would show
    assert outputs["loss"].item() == pytest.approx(0.3 * parts[0] + 0.7 * parts[1]
                                                   + 2.0 * parts[2], rel=1e-5)

    outputs["loss"].backward()
    for module in ("backbone", "projector", "predictor", "centroid_predictor", "psi"):
        params = list(getattr(method, module).parameters())
        assert params and all(p.grad is not None and torch.isfinite(p.grad).all()
                              for p in params), module
        assert sum(float(p.grad.abs().sum()) for p in params) > 0, module
    momentum = [*method.momentum_backbone.parameters(), *method.momentum_projector.parameters()]
    assert momentum and all(not p.requires_grad and p.grad is None for p in momentum)
    grouped = {id(p) for group in method.param_groups() for p in group["params"]}
    assert not grouped & {id(p) for p in momentum}
    assert grouped == {id(p) for p in trainable(method)}


PAPER = """
name: paper
method: all4one
all4one: {}
"""
AUTHORS = """
name: authors
method: all4one
all4one: {symmetric: true, temperature: 0.2, centroid_temperature: 0.1, eta: 2.5,
          redundancy_lambda: 1.0}
"""


def solo_learn_on_off(t1: Tensor, z2: Tensor, t2: Tensor, z1: Tensor) -> tuple[Tensor, Tensor]:
    """The square roots of solo-learn's all4one feature term (means over the diagonal and the
    off-diagonal of both cross-correlations), written independently of raycl.losses."""
    def columns(z: Tensor) -> Tensor:
        return z / z.norm(dim=0, keepdim=True)

    cc1, cc2 = columns(t1).T @ columns(z2), columns(t2).T @ columns(z1)
    off = ~torch.eye(cc1.shape[0], dtype=torch.bool)
    on_diag = ((((cc1.diagonal() - 1) ** 2).mean() + ((cc2.diagonal() - 1) ** 2).mean()) / 2)
    off_diag = ((cc1[off] ** 2).mean() + (cc2[off] ** 2).mean()) / 2
    return on_diag.sqrt(), off_diag.sqrt()


@pytest.mark.parametrize("preset", ["paper", "authors"])
def test_weighting_presets_match_a_by_hand_objective(preset: str) -> None:
    """Both presets build from YAML, and the whole objective is rebuilt by hand from the
    method's modules; the authors' preset weights the feature term exactly as solo-learn does,
    ``0.5 * 10 * (0.5 on + 0.5 off)`` with on/off the square roots."""
    raw = yaml.safe_load(PAPER if preset == "paper" else AUTHORS)
    raw["model"] = MODEL
    raw["all4one"].update(queue_size=30, neighbours=3, predictor_hidden_dim=32,
                          transformer_layers=1, transformer_heads=2, transformer_feedforward=32)
    torch.manual_seed(0)
    method = build_method(search_config_class().model_validate(raw), in_channels=1)
    assert isinstance(method, All4One)
    knobs = method.section
    if preset == "paper":
        assert (knobs.symmetric, knobs.temperature, knobs.centroid_temperature) == \
            (False, 0.1, 0.1)
        assert (weights(method), knobs.redundancy_lambda) == ((0.5, 0.5, 5.0), 0.5)
        assert method.psi.encoder.layers[0].dropout.p == 0.1
        assert (knobs.momentum_start, knobs.momentum_end) == (0.99, 1.0)
    else:
        assert (knobs.symmetric, knobs.temperature, knobs.centroid_temperature) == \
            (True, 0.2, 0.1)
        assert (weights(method), knobs.redundancy_lambda) == ((0.5, 0.5, 2.5), 1.0)
    method.psi.eval()  # ψ's dropout off, so the rebuild below sees the same ψ
    drift(method)
    method(make_batch(0))
    snapshot = method.queue.embeddings.clone()
    batch = make_batch(1)
    outputs = method(batch)

    # Train-mode BatchNorm depends on the batch only: the same inputs give the same outputs.
    views, k = torch.cat(batch.views), knobs.neighbours
    z1, z2 = method.project(views).chunk(2)
    with torch.no_grad():
        t1, t2 = method.momentum_project(views).chunk(2)
    assert not torch.allclose(t1, z1)
    p1, p2 = method.predictor(torch.cat([z1, z2])).chunk(2)
    pc1, pc2 = method.centroid_predictor(torch.cat([z1, z2])).chunk(2)
    nn1, nn2 = nearest_rows(snapshot, t1, k), nearest_rows(snapshot, t2, k)
    tau, tau_c = knobs.temperature, knobs.centroid_temperature
    neighbour = info_nce(nn1[:, 0], p2, tau)
    centroid = info_nce(method.psi(nn1), method.psi(shift(nn2, pc2)), tau_c)
    if knobs.symmetric:
        neighbour = (neighbour + info_nce(nn2[:, 0], p1, tau)) / 2
        centroid = (centroid + info_nce(method.psi(nn2), method.psi(shift(nn1, pc1)), tau_c)) / 2
    on, off = solo_learn_on_off(t1, z2.detach(), t2, z1.detach())
    torch.testing.assert_close(outputs["neighbour_loss"], neighbour.detach())
    torch.testing.assert_close(outputs["centroid_loss"], centroid.detach())
    torch.testing.assert_close(outputs["redundancy_loss"], on + knobs.redundancy_lambda * off)
    torch.testing.assert_close(redundancy_reduction_loss(t1, z2, t2, z1, 1.0).detach(), on + off)
    sigma, kappa, eta = weights(method)
    expected = sigma * neighbour + kappa * centroid + eta * (on + knobs.redundancy_lambda * off)
    torch.testing.assert_close(outputs["loss"].detach(), expected.detach())
    if preset == "authors":
        solo_learn = (0.5 * centroid + 0.5 * neighbour + 0.5 * (0.5 * on + 0.5 * off) * 10)
        torch.testing.assert_close(outputs["loss"].detach(), solo_learn.detach())


def test_shift_puts_the_prediction_first_and_drops_the_last_neighbour() -> None:
    """[q_c(z), nn_1, ..., nn_(k-1)], in the prediction's dtype."""
    neighbours = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    prediction = -torch.ones(2, 3, dtype=torch.float64)
    sequence = shift(neighbours, prediction)
    assert sequence.shape == (2, 4, 3) and sequence.dtype == torch.float64
    assert torch.equal(sequence[:, 0], prediction)
    assert torch.equal(sequence[:, 1:], neighbours[:, :3].double())
    assert not (sequence == neighbours[:, 3:4].double()).all(-1).any()  # the k-th is gone


def test_centroid_encoder() -> None:
    """ψ: (B, k, D) -> (B, D), element 0 of the encoder over sequence + positions."""
    torch.manual_seed(0)
    psi = CentroidEncoder(dim=16, length=4, layers=1, heads=2, feedforward=32, dropout=0.0).eval()
    sequence = torch.randn(3, 4, 16)
    with torch.no_grad():
        centroid = psi(sequence)
        encoded = psi.encoder(sequence + sinusoidal_positional_encoding(4, 16))
        unpositioned = psi.encoder(sequence)[:, 0]
    assert centroid.shape == (3, 16)
    torch.testing.assert_close(centroid, encoded[:, 0])
    assert not torch.allclose(centroid, encoded[:, 1])
    assert not torch.allclose(centroid, unpositioned)  # the positions are added
    with pytest.raises(ValueError, match="heads must divide"):
        CentroidEncoder(dim=16, length=4, layers=1, heads=3, feedforward=32, dropout=0.0)


def test_centroid_positions_sequence_and_feature_layouts() -> None:
    """k = 2 neighbours of width D = 3, by hand. Sequence (the paper): row j encodes position j
    over the 3 features (frequencies 1 and 10000^(-2/3)). Feature (the authors' code): column d
    encodes position d over the k = 2 channels (frequency 1), so row 0 is sin(d), row 1 cos(d)."""
    slow = 10_000.0 ** (-2 / 3)
    sequence = torch.tensor([[0.0, 1.0, 0.0],
                             [math.sin(1), math.cos(1), math.sin(slow)]])
    feature = torch.tensor([[0.0, math.sin(1), math.sin(2)],
                            [1.0, math.cos(1), math.cos(2)]])
    torch.testing.assert_close(centroid_positions(2, 3, "sequence"), sequence)
    torch.testing.assert_close(centroid_positions(2, 3, "feature"), feature)
    # An odd k (the paper's 5) takes the frequencies of the even width above, the last cosine
    # dropped: channel 4 is sin(d * 10000^(-4/6)).
    odd = centroid_positions(5, 8, "feature")
    assert odd.shape == (5, 8)
    torch.testing.assert_close(odd[4], torch.sin(torch.arange(8.0) * 10_000.0 ** (-4 / 6)))
    torch.testing.assert_close(centroid_positions(4, 6, "feature"),
                               sinusoidal_positional_encoding(6, 4).T)
    with pytest.raises(ValueError, match="sequence"):
        centroid_positions(2, 3, "batch")


@pytest.mark.parametrize("layout", ["sequence", "feature"])
def test_all4one_position_encoding_from_config(layout: str) -> None:
    """all4one.position_encoding reaches ψ; the positions are not in the state dict, so a
    checkpoint of either layout loads into the other."""
    raw = yaml.safe_load(PAPER)
    raw["model"] = MODEL
    raw["all4one"].update(queue_size=30, neighbours=3, predictor_hidden_dim=32,
                          transformer_layers=1, transformer_heads=2, transformer_feedforward=32,
                          position_encoding=layout)
    method = build_method(search_config_class().model_validate(raw), in_channels=1)
    assert isinstance(method, All4One)
    dim = MODEL["projector_dim"]
    torch.testing.assert_close(method.psi.positions, centroid_positions(3, dim, layout))
    assert not any("positions" in key for key in method.state_dict())
    with torch.no_grad():
        sequence = torch.randn(2, 3, dim)
        method.psi.eval()
        torch.testing.assert_close(
            method.psi(sequence),
            method.psi.encoder(sequence + centroid_positions(3, dim, layout))[:, 0])


# ---------------------------------------------------------------- momentum branch


def test_ema_update_follows_the_schedule() -> None:
    """momentum = c·momentum + (1 - c)·online with BYOL's schedule; frozen at the last step;
    BatchNorm statistics are not averaged."""
    method = build("all4one")
    pairs = [(method.backbone, method.momentum_backbone),
             (method.projector, method.momentum_projector)]
    with torch.no_grad():
        for param in trainable(method):
            param.add_(0.1 * torch.randn_like(param))  # the online branch moved on
    old = [p.clone() for _, target in pairs for p in target.parameters()]
    running_mean = method.momentum_backbone[0][1].running_mean.clone()

    method.on_train_step_end(3, 10)
    coefficient = momentum_coefficient(3, 10, 0.99, 1.0)
    assert 0.99 < coefficient < 1.0
    online = [p for source, _ in pairs for p in source.parameters()]
    new = [p for _, target in pairs for p in target.parameters()]
    assert len(old) == len(online) == len(new)
    for before, source, after in zip(old, online, new, strict=True):
        torch.testing.assert_close(after, coefficient * before + (1 - coefficient) * source)
        assert not torch.equal(after, before)
    assert torch.equal(method.momentum_backbone[0][1].running_mean, running_mean)

    frozen = [p.clone() for p in new]
    method.on_train_step_end(10, 10)  # the last step: coefficient 1
    assert all(torch.equal(p, q) for p, q in zip(new, frozen, strict=True))


# ---------------------------------------------------------------- optimizer groups


def test_transformer_param_group_and_learning_rates() -> None:
    """ψ has its own optimizer group: lr scaled from train.lr, or absolute."""
    method = build("all4one")
    groups = {group["name"]: group for group in method.param_groups()}
    assert set(groups) == {"default", "transformer"}
    assert [id(p) for p in groups["transformer"]["params"]] == \
        [id(p) for p in method.psi.parameters()]

    def learning_rates(**section: Any) -> dict[str, float]:
        cfg = make_cfg("all4one", section, train={"lr": 0.01})
        optimizer = build_optimizer(All4One.from_config(cfg, 1), cfg)
        assert all(group["initial_lr"] == group["lr"] for group in optimizer.param_groups)
        return {group["name"]: group["lr"] for group in optimizer.param_groups}

    assert learning_rates() == {"default": 0.01, "transformer": 0.01}
    scaled = learning_rates(transformer_lr_scale=0.1)
    assert scaled["default"] == 0.01 and scaled["transformer"] == pytest.approx(0.001)
    assert learning_rates(transformer_lr=0.5) == {"default": 0.01, "transformer": 0.5}
    # An absolute lr wins over the scale.
    assert learning_rates(transformer_lr=0.5, transformer_lr_scale=0.1)["transformer"] == 0.5


# ---------------------------------------------------------------- checkpointing


@pytest.mark.parametrize("name", ["nnclr", "all4one"])
def test_state_dict_carries_the_queue(name: str, tmp_path: Path) -> None:
    """A method restored from a weights-only checkpoint has the same support set and loss."""
    source = build(name, seed=0)
    for step in range(3):
        source(make_batch(step))
        source.on_train_step_end(step + 1, 10)
    state = source.state_dict()
    assert {"queue.embeddings", "queue.sample_index", "queue.pointer"} <= set(state)
    assert int(state["queue.pointer"]) == 18 and int((state["queue.sample_index"] >= 0).sum()) == 18
    torch.save(state, tmp_path / "method.pt")

    target = build(name, seed=1)
    fresh_loss = target(make_batch(3))["loss"]
    target.load_state_dict(torch.load(tmp_path / "method.pt", weights_only=True))
    for key in ("embeddings", "sample_index", "pointer"):
        assert torch.equal(getattr(target.queue, key), getattr(source.queue, key)), key

    expected, restored = source(make_batch(3)), target(make_batch(3))
    torch.testing.assert_close(restored["loss"], expected["loss"])
    assert not torch.allclose(fresh_loss, expected["loss"])
    assert torch.equal(target.queue.embeddings, source.queue.embeddings)


# ---------------------------------------------------------------- NN retrieval


@pytest.mark.parametrize("name", ["nnclr", "all4one"])
def test_neighbour_retrieval_returns_the_enqueued_index(name: str) -> None:
    """An image whose query was enqueued retrieves its own training index; the queries are what
    training enqueues (NNCLR: online projections, All4One: momentum projections)."""
    method = build(name)
    drift(method)
    method(make_batch(0))  # train-mode step: BN statistics move off their init
    method.eval()
    images = make_batch(1).images
    with torch.no_grad():
        queries = method.queries(images)
        trained = method.project(images) if name == "nnclr" else method.momentum_project(images)
        torch.testing.assert_close(queries, trained)
        if name == "all4one":
            assert not torch.allclose(queries, method.project(images))
        method.queue.enqueue(queries, torch.arange(100, 106))
    found = method.neighbour_retrieval(images)
    assert found.dtype == torch.int64 and found.shape == (6,)
    assert torch.equal(found, torch.arange(100, 106))


def tiny_splits() -> DatasetSplits:
    """8 training and 4 validation images; validation image i is training image
    ``[0, 3, 5, 6][i]``."""
    rng = np.random.default_rng(0)
    train_images = rng.integers(0, 256, size=(8, 1, 16, 16), dtype=np.uint8)
    train = ImageSet(train_images, {"shape": np.arange(8) % 4, "color": np.arange(8) // 4})
    val_of = np.array([0, 3, 5, 6])
    # shape agrees for 3 of 4 (not the last), colour for 2 of 4 (the first two).
    val = ImageSet(train_images[val_of], {"shape": np.array([0, 3, 1, 0]),
                                          "color": np.array([0, 0, 0, 0])})
    empty = ImageSet(train_images[:0], {"shape": np.zeros(0, int), "color": np.zeros(0, int)})
    return DatasetSplits(name="tiny", train=train, val=val, test=empty,
                         attributes=["shape", "color"], num_classes={"shape": 4, "color": 2},
                         channels=1, resolution=16)


@pytest.mark.parametrize("name", ["nnclr", "all4one"])
def test_neighbour_retrieval_accuracy(name: str) -> None:
    """val/nn_retrieval/<attribute> and /mean: does the retrieved training sample share the
    query's label; {} while the queue holds no samples and for a method without a queue."""
    from raycl.data.augment import to_float

    data = tiny_splits()
    method = build(name)
    device = torch.device("cpu")
    assert neighbour_retrieval_accuracy(method, data, ("val",), device) == {}  # only noise
    method.eval()
    with torch.no_grad():
        queries = method.queries(to_float(torch.from_numpy(data.train.images)))
        method.queue.enqueue(queries, torch.arange(8))
    method.train()
    metrics = neighbour_retrieval_accuracy(method, data, ("val",), device, batch_size=3)
    assert metrics == pytest.approx({"val/nn_retrieval/shape": 0.75,
                                     "val/nn_retrieval/color": 0.5,
                                     "val/nn_retrieval/mean": 0.625})
    assert method.training  # the mode is restored

    torch.manual_seed(0)
    simclr = build_method(make_cfg("simclr"), in_channels=1)
    assert isinstance(simclr, SimCLR)
    assert neighbour_retrieval_accuracy(simclr, data, ("val",), device) == {}


# ---------------------------------------------------------------- config


SEARCH = """
name: a
method: all4one
data: {dataset: trifeature, resolution: 32, samples_per_combination: 2}
train: {epochs: 2, batch_size: 64}
tune: {num_samples: 1}
"""


def test_heads_must_divide_the_projector_width(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Caught at load time, one line naming the key; the command line exits 2."""
    text = SEARCH + "model: {projector_dim: 12}\nall4one: {transformer_heads: 8}\n"
    message = error_of(tmp_path, text)
    assert message.startswith(f"{tmp_path / 'search.yaml'}: all4one.transformer_heads: ")
    assert "8 heads must divide model.projector_dim (12)" in message
    assert main([str(tmp_path / "search.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {tmp_path / 'search.yaml'}: all4one.transformer_heads: ")
    assert "\n" not in err
    load_search(write(tmp_path, text), ["all4one.transformer_heads=4"])  # 4 divides 12


def test_searched_heads_are_checked_against_the_projector_width(tmp_path: Path) -> None:
    """Every offered value is checked before launch, not when its trial builds the method."""
    space = ("tune: {num_samples: 1, search_space: "
             "{all4one.transformer_heads: {choice: [4, 3]}}}\n")
    message = error_of(tmp_path, SEARCH.replace("tune: {num_samples: 1}\n", space))
    assert message.startswith(f"{tmp_path / 'search.yaml'}: "
                              f"tune.search_space.all4one.transformer_heads: value 3: ")
    assert "3 heads must divide model.projector_dim (64)" in message
    fine = SEARCH.replace("tune: {num_samples: 1}\n", space.replace("4, 3", "4, 8"))
    load_search(write(tmp_path, fine))


def test_queue_must_hold_the_neighbours(tmp_path: Path) -> None:
    """queue_size < neighbours is rejected; equal is fine."""
    message = error_of(tmp_path, SEARCH + "all4one: {queue_size: 4, neighbours: 5}\n")
    assert message.startswith(f"{tmp_path / 'search.yaml'}: all4one: ")
    assert "queue_size (4) must hold at least the 5 neighbours" in message
    load_search(write(tmp_path, SEARCH + "all4one: {queue_size: 5, neighbours: 5}\n"))


def test_mcl_over_all4one_needs_the_sampler(tmp_path: Path) -> None:
    """All4One cannot mask its negatives: MCL over it must use the sampler."""
    mcl = SEARCH.replace("method: all4one", "method: mcl") + \
        "mcl: {base: all4one, stages: 2, clusters: 2, negatives: NEG}\n"
    message = error_of(tmp_path, mcl.replace("NEG", "mask"))
    assert message.startswith(f"{tmp_path / 'search.yaml'}: mcl.negatives: ")
    assert "all4one does not" in message
    config = load_search(write(tmp_path, mcl.replace("NEG", "sampler")))
    assert (config.method, config.mcl.base, config.mcl.negatives) == ("mcl", "all4one", "sampler")


def test_sections_are_in_the_schema_and_settable(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """nnclr.* and all4one.* are documented keys that --set changes and validates."""
    schema = schema_markdown()
    for key in ("nnclr.temperature", "nnclr.queue_size", "nnclr.symmetric", "all4one.sigma",
                "all4one.kappa", "all4one.eta", "all4one.transformer_lr",
                "all4one.momentum_start"):
        assert key in CONFIG_KEYS and f"`{key}`" in schema, key
    path = write(tmp_path, SEARCH)
    config = load_search(path, ["all4one.sigma=0.2", "all4one.symmetric=true"])
    assert (config.all4one.sigma, config.all4one.symmetric) == (0.2, True)
    assert load_search(path).all4one.sigma == 0.5
    assert "all4one.sigma" in error_of(tmp_path, SEARCH, ["all4one.sigma=-1"])
    assert "momentum_start (1.0) must not exceed momentum_end (0.99)" in error_of(
        tmp_path, SEARCH, ["all4one.momentum_start=1.0", "all4one.momentum_end=0.99"])
    storage, tracking = tmp_path / "ray", f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main([str(path), "--set", "all4one.sigma=0.2", "--dry-run", "--storage",
                 str(storage), "--tracking-uri", tracking]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["all4one"]["sigma"] == 0.2
    assert not storage.exists()


# ---------------------------------------------------------------- NNCLR loss


@pytest.mark.parametrize("symmetric", [False, True])
def test_nnclr_loss_by_hand(symmetric: bool) -> None:
    """symmetric=False: info_nce(nn(z1), q(z2)); True: averaged with info_nce(nn(z2), q(z1))."""
    method = build("nnclr", symmetric=symmetric)
    method(make_batch(0))
    snapshot = method.queue.embeddings.clone()
    batch = make_batch(1)
    loss = method(batch)["loss"]
    with torch.no_grad():
        z1, z2 = method.project(torch.cat(batch.views)).chunk(2)
        p1, p2 = method.predictor(torch.cat([z1, z2])).chunk(2)

    one_way = info_nce(nearest_rows(snapshot, z1, 1)[:, 0], p2, 0.1)
    other_way = info_nce(nearest_rows(snapshot, z2, 1)[:, 0], p1, 0.1)
    assert not math.isclose(one_way.item(), other_way.item(), rel_tol=1e-3)
    expected = (one_way + other_way) / 2 if symmetric else one_way
    torch.testing.assert_close(loss.detach(), expected)
