"""MoCo v2 and SimSiam, FGVR's base methods: their losses, MoCo's key queue and key encoder, and
their config sections.

Tiny sizes throughout (small_cnn width 8, 16x16 greyscale images, 16-d projections, a queue of
20 entries), so the whole file runs in seconds on a CPU.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raycl.config.schema import ConfigError, CoreConfig
from raycl.config.search_config import CONFIG_KEYS, schema_markdown, search_config_class
from raycl.launch.load import load_search
from raycl.losses import moco_infonce, simsiam_loss
from raycl.methods import METHODS, Batch, build_method
from raycl.methods.mocov2 import MoCoV2, MoCoV2Config
from raycl.methods.simsiam import SimSiam, SimSiamConfig
from raycl.methods.two_view import encode_views
from raycl.models.momentum import momentum_coefficient

MODEL = {"backbone": "small_cnn", "width": 8, "projector_hidden_dim": 32, "projector_dim": 16}
SECTIONS: dict[str, dict[str, Any]] = {
    "mocov2": {"queue_size": 20},
    "simsiam": {"predictor_hidden_dim": 8},
}
NUM_SAMPLES, BATCH, QUEUE = 12, 6, 20
DATASET = torch.randn(NUM_SAMPLES, 1, 16, 16, generator=torch.Generator().manual_seed(321))


# One intra-op thread for these tiny models (see conftest.one_torch_thread).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_cfg(method: str, section: dict[str, Any] | None = None, **core: Any) -> CoreConfig:
    """A validated config for ``method`` with tiny model sizes; ``section`` overrides knobs."""
    raw: dict[str, Any] = {"name": "x", "method": method, "model": MODEL, **core,
                           method: {**SECTIONS[method], **(section or {})}}
    return search_config_class().model_validate(raw)


def build_moco(seed: int = 0, **section: Any) -> MoCoV2:
    torch.manual_seed(seed)
    method = build_method(make_cfg("mocov2", section), in_channels=1)
    assert isinstance(method, MoCoV2)
    return method


def build_simsiam(seed: int = 0, **section: Any) -> SimSiam:
    torch.manual_seed(seed)
    method = build_method(make_cfg("simsiam", section), in_channels=1)
    assert isinstance(method, SimSiam)
    return method


def make_batch(step: int = 0, noise: float = 0.05) -> Batch:
    """Batch ``step`` of the 12-sample dataset (samples 0-5 on even steps, 6-11 on odd ones);
    two views of fresh noise each step."""
    generator = torch.Generator().manual_seed(2000 + step)
    index = torch.arange(BATCH) + BATCH * (step % 2)
    images = DATASET[index]
    views = [images + noise * torch.randn(images.shape, generator=generator) for _ in range(2)]
    return Batch(images=images, views=views, index=index)


def trainable(method: nn.Module) -> list[nn.Parameter]:
    return [param for param in method.parameters() if param.requires_grad]


def key_params(method: MoCoV2) -> list[nn.Parameter]:
    return [*method.key_backbone.parameters(), *method.key_projector.parameters()]


@torch.no_grad()
def drift(method: nn.Module, scale: float = 0.05) -> None:
    """Moves the online networks away from the key encoder, as optimizer steps would."""
    generator = torch.Generator().manual_seed(7)
    for param in trainable(method):
        param.add_(scale * torch.randn(param.shape, generator=generator))


# ---------------------------------------------------------------- moco_infonce


def test_moco_infonce_by_hand() -> None:
    """Two queries, two negatives, τ = 0.5; inputs not unit length (normalised inside).

    q1 = (1, 0), k1 = (1, 0): logits [1, 0, -1] / 0.5 = [2, 0, -2].
    q2 = (0, 1), k2 = (1, 0): logits [0, 1, 0] / 0.5 = [0, 2, 0].
    """
    queries = torch.tensor([[3.0, 0.0], [0.0, 0.5]])
    keys = torch.tensor([[2.0, 0.0], [4.0, 0.0]])
    negatives = torch.tensor([[0.0, 1.0], [-1.0, 0.0]])
    first = -math.log(math.exp(2) / (math.exp(2) + 1 + math.exp(-2)))
    second = -math.log(1 / (1 + math.exp(2) + 1))
    loss = moco_infonce(queries, keys, negatives, temperature=0.5)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert loss.item() == pytest.approx((first + second) / 2, rel=1e-6)


def loop_reference(queries: Tensor, keys: Tensor, negatives: Tensor, tau: float) -> float:
    """-log softmax of the positive, query by query, in float64 Python loops."""
    total = 0.0
    for q, k in zip(queries.detach().double(), keys.detach().double(), strict=True):
        q, k = q / q.norm(), k / k.norm()
        positive = float(q @ k) / tau
        others = [float(q @ (n / n.norm())) / tau for n in negatives.detach().double()]
        denominator = math.exp(positive) + sum(math.exp(value) for value in others)
        total += -(positive - math.log(denominator))
    return total / len(queries)


def test_moco_infonce_matches_a_loop_and_sends_no_gradient_to_keys() -> None:
    """Random case against the loop; gradients reach the queries only; float32 logits under
    half-precision autocast."""
    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(5, 8, generator=generator, requires_grad=True)
    keys = torch.randn(5, 8, generator=generator, requires_grad=True)
    negatives = torch.randn(7, 8, generator=generator, requires_grad=True)
    loss = moco_infonce(queries, keys, negatives, temperature=0.2)
    assert loss.item() == pytest.approx(loop_reference(queries, keys, negatives, 0.2), rel=1e-5)
    loss.backward()
    assert queries.grad is not None and queries.grad.abs().sum() > 0
    assert keys.grad is None and negatives.grad is None

    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = moco_infonce(queries.bfloat16(), keys.bfloat16(), negatives, temperature=0.2)
    assert mixed.dtype == torch.float32
    exact = moco_infonce(queries.bfloat16().float(), keys.bfloat16().float(), negatives, 0.2)
    torch.testing.assert_close(mixed, exact)  # no bfloat16 matmul in between


def test_moco_infonce_validation() -> None:
    q, k, n = torch.randn(3, 4), torch.randn(3, 4), torch.randn(5, 4)
    for temperature in (0.0, -0.1, math.inf, math.nan):
        with pytest.raises(ValueError, match="temperature"):
            moco_infonce(q, k, n, temperature)
    with pytest.raises(ValueError, match="same shape"):
        moco_infonce(q, k[:2], n, 0.2)
    with pytest.raises(ValueError, match="2-D"):
        moco_infonce(q[0], k[0], n, 0.2)
    with pytest.raises(ValueError, match="at least one sample"):
        moco_infonce(q[:0], k[:0], n, 0.2)
    with pytest.raises(ValueError, match="negatives must be"):
        moco_infonce(q, k, torch.randn(5, 6), 0.2)
    with pytest.raises(ValueError, match="negatives must be"):
        moco_infonce(q, k, torch.randn(4), 0.2)
    with pytest.raises(ValueError, match="at least one row"):
        moco_infonce(q, k, n[:0], 0.2)


# ---------------------------------------------------------------- MoCo v2: the queue


def expected_keys(method: MoCoV2, batch: Batch) -> tuple[Tensor, Tensor]:
    """The keys the step should enqueue and their sample indices, recomputed: view 2's keys
    (each encoder over one view's batch, as MoCo), or [k2; k1] from one pass when symmetric.
    Train-mode BatchNorm depends on the batch only, so the same inputs give the same keys."""
    with torch.no_grad():
        if method.section.symmetric:
            k1, k2 = encode_views(method.key_project, batch)
            return torch.cat([k2, k1]), torch.cat([batch.index, batch.index])
        return method.key_project(batch.views[1]), batch.index


@pytest.mark.parametrize("symmetric", [False, True])
def test_mocov2_enqueues_keys_not_queries(symmetric: bool) -> None:
    """After a forward, the newest queue rows are the key encoder's normalised projections of
    the batch (view 2 in the paper mode), and not the online queries."""
    method = build_moco(symmetric=symmetric)
    drift(method)  # online and key encoders now differ
    method(make_batch(0))
    start = int(method.queue.pointer)
    assert start == (2 if symmetric else 1) * BATCH
    batch = make_batch(1)
    method(batch)
    keys, index = expected_keys(method, batch)
    newest = (start + torch.arange(len(keys))) % QUEUE  # wraps around when symmetric
    torch.testing.assert_close(method.queue.embeddings[newest], F.normalize(keys, dim=1))
    assert torch.equal(method.queue.sample_index[newest], index)
    with torch.no_grad():
        q1, q2 = method.project(batch.views[0]), method.project(batch.views[1])
        k1_alone = method.key_project(batch.views[0])
    rows = method.queue.embeddings[newest[:BATCH]]
    for wrong in (q1, q2, k1_alone):  # the queries, and (paper mode) the wrong view's keys
        assert not torch.allclose(rows, F.normalize(wrong, dim=1), atol=1e-3)


class QueriesEnqueuedMoCo(MoCoV2):
    """The bug of a public implementation: the online queries are enqueued instead of keys."""

    def forward(self, batch: Batch) -> dict[str, Tensor]:
        enqueue = self.queue.enqueue
        self.queue.enqueue = lambda _keys, index: enqueue(  # type: ignore[method-assign]
            self.project(batch.views[0]).detach(), index)
        try:
            return super().forward(batch)
        finally:
            del self.queue.enqueue


def test_enqueued_queries_are_caught() -> None:
    """The check above has teeth: a forward that enqueues the queries fails it."""
    torch.manual_seed(0)
    method = QueriesEnqueuedMoCo.from_config(make_cfg("mocov2"), in_channels=1)
    drift(method)
    batch = make_batch(0)
    method(batch)
    keys, _ = expected_keys(method, batch)
    assert not torch.allclose(method.queue.embeddings[:BATCH], F.normalize(keys, dim=1),
                              atol=1e-3)


@pytest.mark.parametrize("symmetric", [False, True])
def test_the_loss_never_sees_its_own_keys(symmetric: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss is computed over the queue as it was before the step, then the keys are
    enqueued: recomputed by hand from a snapshot, and the call order spied."""
    import raycl.methods.mocov2 as mocov2_module

    method = build_moco(symmetric=symmetric)
    drift(method)
    method(make_batch(0))  # part of the queue holds real keys, the rest noise
    snapshot = method.queue.embeddings.clone()
    events: list[str] = []
    seen: list[Tensor] = []
    loss_function, enqueue = mocov2_module.moco_infonce, method.queue.enqueue

    def spy_loss(queries: Tensor, keys: Tensor, negatives: Tensor, tau: float) -> Tensor:
        events.append("loss")
        seen.append(negatives.clone())
        return loss_function(queries, keys, negatives, tau)

    def spy_enqueue(embeddings: Tensor, sample_index: Tensor) -> None:
        events.append("enqueue")
        enqueue(embeddings, sample_index)

    monkeypatch.setattr(mocov2_module, "moco_infonce", spy_loss)
    monkeypatch.setattr(method.queue, "enqueue", spy_enqueue)
    batch = make_batch(1)
    loss = method(batch)["loss"]
    assert events == (["loss", "loss", "enqueue"] if symmetric else ["loss", "enqueue"])
    assert all(torch.equal(negatives, snapshot) for negatives in seen)

    tau = method.section.temperature
    with torch.no_grad():
        if symmetric:
            q1, q2 = encode_views(method.project, batch)
            k1, k2 = encode_views(method.key_project, batch)
            expected = (loop_reference(q1, k2, snapshot, tau)
                        + loop_reference(q2, k1, snapshot, tau)) / 2
            after = (moco_infonce(q1, k2, method.queue.embeddings, tau)
                     + moco_infonce(q2, k1, method.queue.embeddings, tau)) / 2
        else:
            q1, k2 = method.project(batch.views[0]), method.key_project(batch.views[1])
            expected = loop_reference(q1, k2, snapshot, tau)
            after = moco_infonce(q1, k2, method.queue.embeddings, tau)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    # With its own keys among the negatives the loss would be another number.
    assert not math.isclose(after.item(), expected, rel_tol=1e-3)


# ---------------------------------------------------------------- MoCo v2: key encoder


def test_mocov2_architecture_and_outputs() -> None:
    """MoCo v2's head: Linear-ReLU-Linear with biases, no BatchNorm; forward/backward reaches
    the query encoder only; project is the online projection."""
    method = build_moco()
    layers = list(method.projector)
    assert [type(layer) for layer in layers] == [nn.Linear, nn.ReLU, nn.Linear]
    assert all(layer.bias is not None for layer in layers if isinstance(layer, nn.Linear))
    knobs = method.section
    assert (knobs.temperature, knobs.momentum_start, knobs.momentum_end, knobs.symmetric) == \
        (0.2, 0.999, 0.999, False)
    assert not MoCoV2.accepts_negative_mask and method.neighbour_retrieval(DATASET) is None
    drift(method)
    outputs = method(make_batch(0))
    assert set(outputs) == {"loss", "pos_sim", "queue_fill"}
    assert outputs["loss"].dim() == 0 and torch.isfinite(outputs["loss"])
    assert not outputs["pos_sim"].requires_grad
    assert outputs["queue_fill"].item() == pytest.approx(BATCH / QUEUE)
    outputs["loss"].backward()
    for module in (method.backbone, method.projector):
        params = list(module.parameters())
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
        assert sum(float(p.grad.abs().sum()) for p in params) > 0
    assert all(not p.requires_grad and p.grad is None for p in key_params(method))
    with torch.no_grad():
        images = make_batch(0).images
        torch.testing.assert_close(method.project(images),
                                   method.projector(method.backbone(images)))
        assert not torch.allclose(method.project(images), method.key_project(images), atol=1e-3)


@pytest.mark.parametrize(("start", "end"), [(0.999, 0.999), (0.99, 1.0)])
def test_key_encoder_follows_the_momentum_coefficient(start: float, end: float) -> None:
    """key = c·key + (1 - c)·online after each step, with c constant (MoCo) or on BYOL's
    schedule; BatchNorm statistics are not averaged; key parameters are in no optimizer group."""
    method = build_moco(momentum_start=start, momentum_end=end)
    assert (method.section.momentum_start, method.section.momentum_end) == (start, end)
    pairs = [(method.backbone, method.key_backbone), (method.projector, method.key_projector)]
    drift(method, scale=0.1)
    old = [p.clone() for p in key_params(method)]
    running_mean = method.key_backbone[0][1].running_mean.clone()

    method.on_train_step_end(3, 10)
    coefficient = momentum_coefficient(3, 10, start, end)
    if start == end:
        assert coefficient == pytest.approx(0.999)
    else:
        assert start < coefficient < end
    online = [p for source, _ in pairs for p in source.parameters()]
    new = key_params(method)
    assert len(old) == len(online) == len(new) > 0
    for before, source, after in zip(old, online, new, strict=True):
        torch.testing.assert_close(after, coefficient * before + (1 - coefficient) * source)
        assert not torch.equal(after, before)
    assert torch.equal(method.key_backbone[0][1].running_mean, running_mean)

    grouped = [p for group in method.param_groups() for p in group["params"]]
    assert {id(p) for p in grouped} == {id(p) for p in trainable(method)}
    assert {id(p) for p in trainable(method)} == \
        {id(p) for p in [*method.backbone.parameters(), *method.projector.parameters()]}
    assert not {id(p) for p in grouped} & {id(p) for p in key_params(method)}


def test_mocov2_state_dict_carries_queue_and_key_encoder(tmp_path: Path) -> None:
    """A method restored from a weights-only checkpoint has the same queue, key encoder and
    loss; the queue has wrapped around."""
    source = build_moco(seed=0)
    for step in range(4):  # 24 writes into 20 entries
        source(make_batch(step))
        source.on_train_step_end(step + 1, 10)
    state = source.state_dict()
    assert {"queue.embeddings", "queue.sample_index", "queue.pointer"} <= set(state)
    assert any(key.startswith("key_backbone.") for key in state)
    assert any(key.startswith("key_projector.") for key in state)
    assert int(state["queue.pointer"]) == 4 * BATCH % QUEUE
    assert int((state["queue.sample_index"] >= 0).sum()) == QUEUE
    torch.save(state, tmp_path / "method.pt")

    target = build_moco(seed=1)
    fresh_loss = target(make_batch(4))["loss"]
    target.load_state_dict(torch.load(tmp_path / "method.pt", weights_only=True))
    for key in ("embeddings", "sample_index", "pointer"):
        assert torch.equal(getattr(target.queue, key), getattr(source.queue, key)), key
    expected, restored = source(make_batch(4)), target(make_batch(4))
    torch.testing.assert_close(restored["loss"], expected["loss"])
    assert not torch.allclose(fresh_loss, expected["loss"])
    assert torch.equal(target.queue.embeddings, source.queue.embeddings)


def test_mocov2_trains() -> None:
    """A few SGD steps with EMA: finite losses, the queue fills up with real keys."""
    method = build_moco(symmetric=True)
    optimizer = torch.optim.SGD(trainable(method), lr=0.05)
    for step in range(3):
        loss = method(make_batch(step))["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        method.on_train_step_end(step + 1, 3)
        assert torch.isfinite(loss)
    assert method.queue.fill().item() == 1.0  # 36 writes into 20 entries


# ---------------------------------------------------------------- SimSiam


def test_simsiam_loss_by_hand() -> None:
    """Identical directions give -1, orthogonal 0, opposite +1; a mixed case by hand."""
    generator = torch.Generator().manual_seed(0)
    z = torch.randn(4, 8, generator=generator)
    assert simsiam_loss(z, 2 * z, 3 * z, 0.5 * z).item() == pytest.approx(-1.0)
    assert simsiam_loss(z, z, -z, -z).item() == pytest.approx(1.0)
    e1, e2 = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    assert simsiam_loss(e1, e1, e2, e2).item() == pytest.approx(0.0)
    # D(p1, z2) = -cos 60° = -0.5, D(p2, z1) = -cos 180° = 1: L = -0.25 + 0.5.
    p1 = torch.tensor([[1.0, 0.0]])
    z2 = torch.tensor([[0.5, math.sqrt(3) / 2]])
    p2, z1 = torch.tensor([[0.0, 2.0]]), torch.tensor([[0.0, -1.0]])
    assert simsiam_loss(p1, p2, z1, z2).item() == pytest.approx(0.25, abs=1e-6)


def test_simsiam_loss_stops_the_gradient_and_validates() -> None:
    generator = torch.Generator().manual_seed(1)
    p1, p2, z1, z2 = (torch.randn(5, 8, generator=generator, requires_grad=True)
                      for _ in range(4))
    simsiam_loss(p1, p2, z1, z2).backward()
    assert p1.grad is not None and p2.grad is not None
    assert z1.grad is None and z2.grad is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert simsiam_loss(p1.bfloat16(), p2, z1, z2).dtype == torch.float32
    with pytest.raises(ValueError, match="same shape"):
        simsiam_loss(p1, p2, z1, z2[:3])
    with pytest.raises(ValueError, match="same shape"):
        simsiam_loss(p1, p2[:, :4], z1, z2)
    with pytest.raises(ValueError, match="2-D"):
        simsiam_loss(p1[0], p2[0], z1[0], z2[0])
    with pytest.raises(ValueError, match="at least one sample"):
        simsiam_loss(p1[:0], p2[:0], z1[:0], z2[:0])


def test_simsiam_architecture_forward_and_stop_gradient() -> None:
    """Projector: 3 Linear layers, BatchNorm after each (the output included); predictor:
    bottleneck Linear-BN-ReLU-Linear. The loss is simsiam_loss of the method's own z and p;
    backbone, projector and predictor get gradients, exactly those of the loss with z detached."""
    method = build_simsiam()
    kinds = [type(layer) for layer in method.projector]
    assert kinds.count(nn.Linear) == 3 and kinds.count(nn.BatchNorm1d) == 3
    assert kinds[-2:] == [nn.Linear, nn.BatchNorm1d]
    predictor = list(method.predictor)
    assert [type(layer) for layer in predictor] == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]
    assert predictor[0].out_features == 8 and predictor[-1].out_features == 16
    assert not SimSiam.accepts_negative_mask

    batch = make_batch(0)
    outputs = method(batch)
    assert set(outputs) == {"loss", "pos_sim", "z_std"}
    assert not outputs["pos_sim"].requires_grad and not outputs["z_std"].requires_grad
    assert 0 < outputs["z_std"].item() <= 1
    outputs["loss"].backward()
    grads = {name: p.grad.clone() for name, p in method.named_parameters()}
    for module in ("backbone", "projector", "predictor"):
        params = [(name, p) for name, p in method.named_parameters()
                  if name.startswith(module + ".")]
        assert params and all(p.grad is not None and torch.isfinite(p.grad).all()
                              for _, p in params), module
        assert sum(float(p.grad.abs().sum()) for _, p in params) > 0, module

    def grads_of(detach: bool) -> tuple[Tensor, dict[str, Tensor]]:
        method.zero_grad()
        z1, z2 = method.project(torch.cat(batch.views)).chunk(2)
        p1, p2 = method.predictor(torch.cat([z1, z2])).chunk(2)
        t1, t2 = (z1.detach(), z2.detach()) if detach else (z1, z2)
        loss = (-F.cosine_similarity(p1, t2, dim=1).mean() / 2
                - F.cosine_similarity(p2, t1, dim=1).mean() / 2)
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in method.named_parameters()}

    by_hand, stopped = grads_of(detach=True)
    torch.testing.assert_close(outputs["loss"].detach(), by_hand)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, stopped[name], msg=name)
    _, through = grads_of(detach=False)
    assert not torch.allclose(through["backbone.0.0.weight"], grads["backbone.0.0.weight"])


# ---------------------------------------------------------------- config


SEARCH = """
name: a
method: METHOD
data: {dataset: trifeature, resolution: 32, samples_per_combination: 2}
train: {epochs: 2, batch_size: 64}
tune: {num_samples: 1}
"""


def write(tmp_path: Path, method: str, extra: str = "") -> Path:
    path = tmp_path / "search.yaml"
    path.write_text(SEARCH.replace("METHOD", method) + extra)
    return path


def test_paper_defaults() -> None:
    moco, simsiam = MoCoV2Config(), SimSiamConfig()
    assert (moco.temperature, moco.queue_size, moco.momentum_start, moco.momentum_end,
            moco.projector_layers, moco.symmetric) == (0.2, 65_536, 0.999, 0.999, 2, False)
    assert (simsiam.projector_layers, simsiam.predictor_hidden_dim) == (3, 512)


def test_both_build_from_a_config_dict() -> None:
    """``method: mocov2`` / ``simsiam`` with their sections in a plain dict."""
    raw = {"name": "x", "method": "mocov2", "model": MODEL,
           "mocov2": {"temperature": 0.1, "queue_size": 10, "projector_layers": 3,
                      "momentum_start": 0.99, "momentum_end": 1.0, "symmetric": True}}
    torch.manual_seed(0)
    moco = build_method(search_config_class().model_validate(raw), in_channels=1)
    assert isinstance(moco, MoCoV2) and METHODS["mocov2"] is MoCoV2
    knobs = moco.section
    assert (knobs.temperature, moco.queue.size, knobs.momentum_start, knobs.momentum_end,
            knobs.symmetric) == (0.1, 10, 0.99, 1.0, True)
    assert sum(isinstance(layer, nn.Linear) for layer in moco.projector) == 3
    assert moco.queue.embeddings.shape == (10, 16)

    raw = {"name": "x", "method": "simsiam", "model": MODEL,
           "simsiam": {"projector_layers": 2, "predictor_hidden_dim": 4}}
    simsiam = build_method(search_config_class().model_validate(raw), in_channels=1)
    assert isinstance(simsiam, SimSiam) and METHODS["simsiam"] is SimSiam
    assert sum(isinstance(layer, nn.Linear) for layer in simsiam.projector) == 2
    assert simsiam.predictor[0].out_features == 4


def test_sections_are_in_the_schema_settable_and_validated(tmp_path: Path) -> None:
    schema = schema_markdown()
    for key in ("mocov2.temperature", "mocov2.queue_size", "mocov2.momentum_start",
                "mocov2.momentum_end", "mocov2.projector_layers", "mocov2.symmetric",
                "simsiam.projector_layers", "simsiam.predictor_hidden_dim"):
        assert key in CONFIG_KEYS and f"`{key}`" in schema, key
    config = load_search(write(tmp_path, "mocov2"),
                         ["mocov2.temperature=0.1", "mocov2.symmetric=true"])
    assert (config.mocov2.temperature, config.mocov2.symmetric) == (0.1, True)
    config = load_search(write(tmp_path, "simsiam"), ["simsiam.predictor_hidden_dim=64"])
    assert config.simsiam.predictor_hidden_dim == 64

    def error_of(method: str, overrides: list[str], extra: str = "") -> str:
        with pytest.raises(ConfigError) as info:
            load_search(write(tmp_path, method, extra), overrides)
        return str(info.value)

    assert "mocov2.temperature" in error_of("mocov2", ["mocov2.temperature=0"])
    assert "simsiam.predictor_hidden_dim" in error_of("simsiam",
                                                      ["simsiam.predictor_hidden_dim=0"])
    assert "momentum_start (1.0) must not exceed momentum_end (0.999)" in error_of(
        "mocov2", ["mocov2.momentum_start=1.0"])
    mcl = "mcl: {base: mocov2, stages: 2, clusters: 2, negatives: mask}\n"
    assert "mocov2 does not" in error_of("mcl", [], mcl)
    load_search(write(tmp_path, "mcl", mcl.replace("mask", "sampler")))
