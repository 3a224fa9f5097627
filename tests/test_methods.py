"""Tests for the method contract, the registry and SimCLR."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from raycl.config.schema import CoreConfig
from raycl.losses import nt_xent
from raycl.methods import METHODS, Batch, Method, SearchConfig, build_method, register
from raycl.methods.base import Encoder
from raycl.methods.hscl import HSCL, HSCLConfig
from raycl.methods.simclr import SimCLR, SimCLRConfig
from raycl.methods.spectral import SpectralCL


def make_cfg(method: str = "simclr", base: str = "simclr", **sections: dict) -> CoreConfig:
    return SearchConfig(
        name="t", method=method, mcl={"base": base}, data={"resolution": 16},
        model={"backbone": "small_cnn", "width": 4, "projector_hidden_dim": 16,
               "projector_dim": 8},
        **sections,
    )


def make_batch(batch_size: int = 6, channels: int = 1, seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, channels, 16, 16, generator=generator)
    views = [images + 0.1 * torch.randn(images.shape, generator=generator) for _ in range(2)]
    return Batch(images=images, views=views, index=torch.arange(batch_size))


def build_simclr(seed: int = 0, channels: int = 1) -> SimCLR:
    torch.manual_seed(seed)
    method = build_method(make_cfg(), in_channels=channels)
    assert isinstance(method, SimCLR)
    return method


# ---------------------------------------------------------------- registry


def test_registry_contains_simclr() -> None:
    assert METHODS["simclr"] is SimCLR


def test_register_rejects_duplicates_and_non_methods() -> None:
    with pytest.raises(ValueError, match="already registered"):

        @register("simclr")
        class Duplicate(Method):
            pass

    with pytest.raises(ValueError, match="Method subclass"):
        register("not_a_method")(dict)
    assert "not_a_method" not in METHODS
    assert METHODS["simclr"] is SimCLR


def test_register_adds_new_method() -> None:
    try:

        @register("dummy_for_test")
        class Dummy(Method):
            pass

        assert METHODS["dummy_for_test"] is Dummy
    finally:
        METHODS.pop("dummy_for_test", None)


def test_build_method_unknown_names() -> None:
    with pytest.raises(ValueError, match=r"unknown method 'nope'.*simclr"):
        build_method(make_cfg(method="nope"), in_channels=3)
    with pytest.raises(ValueError, match=r"unknown method 'nope' \(MCL base method\)"):
        build_method(make_cfg(method="mcl", base="nope"), in_channels=3)


@pytest.mark.parametrize("method", ["simclr", "mcl"])
def test_build_method_reads_config(method: str) -> None:
    built = build_method(make_cfg(method=method, base="simclr"), in_channels=3)
    assert isinstance(built, SimCLR)
    assert built.section.temperature == 0.5
    assert built.embed(torch.randn(2, 3, 16, 16)).shape == (2, 32)  # 8 * width
    assert built.projector[0].in_features == 32
    assert built.projector[0].out_features == 16
    assert built.projector[-1].out_features == 8


# ---------------------------------------------------------------- base defaults


def test_base_defaults() -> None:
    method = build_simclr()
    groups = method.param_groups()
    assert len(groups) == 1 and groups[0]["name"] == "default"
    assert {id(p) for p in groups[0]["params"]} == {id(p) for p in method.parameters()}
    method.projector.requires_grad_(False)
    frozen_ids = {id(p) for p in method.projector.parameters()}
    assert not frozen_ids & {id(p) for p in method.param_groups()[0]["params"]}

    assert [phase.name for phase in type(method).phases(make_cfg())] == ["train"]
    method.set_phase("train")
    with pytest.raises(ValueError, match="unknown phase 'decoder'"):
        method.set_phase("decoder")
    method.on_train_step_end(step=1, total_steps=10)  # no-op, must not raise


# ---------------------------------------------------------------- SimCLR


def simclr_step(method: SimCLR, batch: Batch) -> tuple[dict[str, Tensor], Tensor]:
    method.zero_grad()
    outputs = method(batch)
    outputs["loss"].backward()
    grad_norm = torch.stack(
        [p.grad.norm() for p in method.backbone.parameters() if p.grad is not None]
    ).sum()
    return outputs, grad_norm


def test_simclr_forward_backward_without_pseudo_labels() -> None:
    method = build_simclr()
    batch = make_batch()
    outputs, grad_norm = simclr_step(method, batch)
    assert set(outputs) == {"loss", "pos_sim"}
    assert outputs["loss"].dim() == 0 and torch.isfinite(outputs["loss"])
    assert not outputs["pos_sim"].requires_grad and -1 <= outputs["pos_sim"].item() <= 1
    assert grad_norm > 0

    # The loss is NT-Xent of the two views' projections.
    projections = method.projector(method.backbone(torch.cat(batch.views)))
    expected = nt_xent(projections[:6], projections[6:], 0.5)
    torch.testing.assert_close(outputs["loss"], expected)


def test_simclr_pseudo_labels_restrict_negatives() -> None:
    method = build_simclr()
    batch = make_batch()
    plain = method(batch)["loss"]

    # All samples in one group: identical to plain SimCLR.
    batch.pseudo_labels = torch.zeros(6, dtype=torch.long)
    torch.testing.assert_close(method(batch)["loss"], plain)

    # Every sample in its own group: no negatives left, the loss is exactly log(1) = 0.
    batch.pseudo_labels = torch.arange(6)
    assert method(batch)["loss"].item() == pytest.approx(0.0, abs=1e-6)

    # Two groups: different from plain, still trainable.
    batch.pseudo_labels = torch.tensor([0, 1, 0, 1, 0, 1])
    outputs, grad_norm = simclr_step(method, batch)
    assert torch.isfinite(outputs["loss"]) and grad_norm > 0
    assert not torch.allclose(outputs["loss"], plain)


def test_simclr_needs_two_views() -> None:
    method = build_simclr()
    batch = make_batch()
    batch.views = batch.views[:1]
    with pytest.raises(ValueError, match="2 views"):
        method(batch)


def test_simclr_rejects_bad_temperature() -> None:
    cfg = make_cfg()
    with pytest.raises(ValueError, match="temperature"):
        cfg.simclr.temperature = 0.0  # the schema
    with pytest.raises(ValueError, match="temperature"):
        SimCLR(Encoder(torch.nn.Identity(), 4, 8, 4), temperature=0.0)  # the class itself


def test_knobs_come_from_the_section_alone() -> None:
    """A method reads its knobs from its config section: a config's, or the section's defaults
    with a few keyword overrides the section validates; the projector is built from model:."""
    encoder = Encoder(torch.nn.Identity(), 4, 8, 4)
    method = SimCLR(encoder, temperature=0.1)
    assert isinstance(method.section, SimCLRConfig) and method.section.temperature == 0.1
    assert SimCLR(Encoder(torch.nn.Identity(), 4, 8, 4)).section == SimCLRConfig()
    assert [m.in_features for m in method.projector if isinstance(m, torch.nn.Linear)] == [4, 8]
    hscl = HSCL(Encoder(torch.nn.Identity(), 4, 8, 4), section=HSCLConfig(filter_exponent=0.3))
    assert (hscl.section.filter_exponent, hscl.section.mu) == (0.3, 1.0)
    with pytest.raises(ValueError, match="filter_exponent"):
        HSCL(Encoder(torch.nn.Identity(), 4, 8, 4), filter_exponent=-1.0)
    with pytest.raises(TypeError, match="not both"):
        SimCLR(encoder, section=SimCLRConfig(), temperature=0.1)
    with pytest.raises(TypeError, match="SimCLRConfig"):
        SimCLR(encoder, section=HSCLConfig())
    with pytest.raises(ValueError, match="extra"):  # a knob the section does not declare
        SimCLR(encoder, temprature=0.1)
    built = build_method(make_cfg(simclr={"temperature": 0.25}), in_channels=1)
    assert built.section is not None and built.section.temperature == 0.25


def test_state_dict_round_trip() -> None:
    source = build_simclr(seed=0)
    simclr_step(source, make_batch())  # move BN running stats away from their init
    target = build_simclr(seed=1)
    images = make_batch(seed=3).images
    source.eval()
    target.eval()
    assert not torch.allclose(source.embed(images), target.embed(images))

    target.load_state_dict(source.state_dict())
    torch.testing.assert_close(target.embed(images), source.embed(images))
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key


def test_checkpoint_state_round_trips_under_weights_only(tmp_path) -> None:
    """raycl checkpoints hold tensors, numbers and plain containers only, so they load with
    ``torch.load(weights_only=True)``: a checkpoint on shared storage cannot run code."""
    from raycl.worker.checkpoints import write_checkpoint
    from raycl.worker.stage_integration import StageInputs

    source = build_simclr(seed=0)
    optimizer = torch.optim.AdamW([{"params": list(source.parameters()), "name": "default",
                                    "initial_lr": 1e-3}], lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    loss = source(make_batch())["loss"]
    loss.backward()
    optimizer.step()
    write_checkpoint(tmp_path, source, optimizer, scaler, {"stage": 0, "epoch": 1,
                                                           "stage_complete": False},
                     StageInputs(), None, {"train/loss": loss.item()})
    state = torch.load(tmp_path / "state.pt", map_location="cpu", weights_only=True)

    target = build_simclr(seed=1)
    target.load_state_dict(state["model"])
    restored = torch.optim.AdamW(target.parameters(), lr=1e-3)
    restored.load_state_dict(state["optimizer"])
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key
    first = next(iter(optimizer.state.values()))
    again = next(iter(restored.state.values()))
    torch.testing.assert_close(again["exp_avg"], first["exp_avg"])
    assert restored.param_groups[0]["name"] == "default"


# ---------------------------------------------------------------- spectral and hscl


def test_spectral_and_hscl_build_from_their_sections() -> None:
    hscl = build_method(make_cfg("hscl", hscl={"filter_exponent": 0.3, "mu": 2.0}), 1)
    assert isinstance(hscl, HSCL) and (hscl.section.filter_exponent, hscl.section.mu) == (0.3, 2.0)
    spectral = build_method(make_cfg("mcl", base="spectral", spectral={"mu": 3.0}), 1)
    assert type(spectral) is SpectralCL and spectral.section.mu == 3.0


def test_hscl_with_p_zero_trains_exactly_like_spectral() -> None:
    torch.manual_seed(0)
    hscl = build_method(make_cfg("hscl", hscl={"filter_exponent": 0.0}), 1)
    spectral = build_method(make_cfg("spectral"), 1)
    spectral.load_state_dict(hscl.state_dict())
    batch = make_batch(batch_size=8)
    losses = []
    for method in (hscl, spectral):
        loss = method(batch)["loss"]
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for a, b in zip(hscl.parameters(), spectral.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("name", ["spectral", "hscl"])
def test_spectral_family_pseudo_labels_restrict_pairs(name: str) -> None:
    """MCL over Spectral CL / HSCL: a pseudo-label split changes the loss; all-equal labels
    change nothing."""
    torch.manual_seed(0)
    method = build_method(make_cfg(name), 1)
    batch = make_batch(batch_size=8)
    plain = method(batch)["loss"]
    batch.pseudo_labels = torch.zeros(8, dtype=torch.long)
    torch.testing.assert_close(method(batch)["loss"], plain)
    batch.pseudo_labels = torch.tensor([0, 1] * 4)
    masked = method(batch)["loss"]
    assert torch.isfinite(masked) and not torch.allclose(masked, plain)
