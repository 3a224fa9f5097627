"""FGVR: the Grad-CAM score, the noise scaling, the memory bank's variance and threshold, what
is detached, the decoder phase (frozen encoder, its own optimizer) and a trial interrupted in
either phase resuming in the right one with the uninterrupted run's numbers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_config import error_of, write
from test_reliability import StoredSession, run
from torch import Tensor, nn

from raycl.eval.figures import method_figures
from raycl.launch.feasibility import max_reports
from raycl.launch.load import load_search
from raycl.methods import Batch, SearchConfig, build_method, stage_epochs, stage_phases
from raycl.methods.fgvr import (
    FGVR,
    column_variance,
    gradcam_scores,
    min_max_normalise,
    noise_std,
    perturb,
)
from raycl.methods.mocov2 import MoCoV2
from raycl.methods.queues import FeatureQueue
from raycl.models.decoder import FeatureDecoder, upsampling_plan
from raycl.worker.optim import build_optimizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = {"backbone": "small_cnn", "width": 4, "projector_hidden_dim": 16, "projector_dim": 8}


def make_cfg(**fgvr: object) -> SearchConfig:
    return SearchConfig(name="t", method="fgvr", data={"resolution": 16}, model=MODEL,
                        fgvr={"memory_size": 32, "decoder_epochs": 1, **fgvr},
                        mocov2={"queue_size": 64})


def make_batch(size: int = 8, seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(size, 3, 16, 16, generator=generator) * 2 - 1
    views = [images + 0.1 * torch.randn(images.shape, generator=generator) for _ in range(2)]
    return Batch(images=images, views=views, index=torch.arange(size))


# ---------------------------------------------------------------- the perturbation


def simclr_loss_by_loop(z1: Tensor, z2: Tensor, temperature: float) -> Tensor:
    """NT-Xent written out anchor by anchor, independently of raycl.losses."""
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    n = len(z1)
    terms = []
    for i in range(2 * n):
        positive = (i + n) % (2 * n)
        logits = torch.stack([z[i] @ z[j] / temperature for j in range(2 * n) if j != i])
        target = positive - (positive > i)
        terms.append(torch.logsumexp(logits, 0) - logits[target])
    return torch.stack(terms).mean()


def test_gradcam_scores_match_autograd_on_a_tiny_model() -> None:
    """η = ReLU(∂L/∂v ⊙ v), min-max normalised per sample, against autograd of a loop-written
    SimCLR loss and a finite difference."""
    torch.manual_seed(0)
    projector = nn.Linear(5, 3)
    v, v2 = torch.randn(4, 5), torch.randn(4, 5)
    scores = gradcam_scores(v, v2, projector, temperature=0.5)

    leaf = v.clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(simclr_loss_by_loop(projector(leaf), projector(v2), 0.5),
                                      leaf)
    eta = torch.relu(gradient * v)
    expected = (eta - eta.min(1, keepdim=True).values) / (
        eta.max(1, keepdim=True).values - eta.min(1, keepdim=True).values)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-4)
    assert scores.min(1).values.eq(0).all() and scores.max(1).values.eq(1).all()

    # The gradient itself, by a central difference on one coordinate.
    step = 1e-3
    plus, minus = v.clone().double(), v.clone().double()
    plus[1, 2] += step
    minus[1, 2] -= step
    projector64 = projector.double()
    with torch.no_grad():
        numeric = (simclr_loss_by_loop(projector64(plus), projector64(v2.double()), 0.5)
                   - simclr_loss_by_loop(projector64(minus), projector64(v2.double()), 0.5)
                   ) / (2 * step)
    assert float(gradient[1, 2]) == pytest.approx(float(numeric), rel=1e-3, abs=1e-6)
    # No parameter gradient is left behind.
    assert all(p.grad is None for p in projector.parameters())


def test_min_max_normalise() -> None:
    values = torch.tensor([[2.0, 4.0, 3.0], [1.0, 1.0, 1.0]])
    torch.testing.assert_close(min_max_normalise(values, dim=1),
                               torch.tensor([[0.0, 1.0, 0.5], [0.0, 0.0, 0.0]]))


def test_noise_is_smaller_on_dimensions_with_higher_scores() -> None:
    """std = ε_g (1 − η̄): a score of 1 gets no noise, 0 the full ε_g, 0.5 half of it."""
    scores = torch.tensor([[0.0, 0.5, 1.0]]).expand(20_000, 3)
    std_g, std_var = noise_std(scores, None, epsilon_g=0.1, epsilon_var=0.05, kappa=0.02)
    assert std_var is None
    torch.testing.assert_close(std_g[0], torch.tensor([0.1, 0.05, 0.0]))
    torch.manual_seed(0)
    features = torch.randn(20_000, 3)
    noise = perturb(features, std_g, None) - features
    empirical = noise.std(dim=0)
    assert empirical[0] > empirical[1] > empirical[2] == 0
    torch.testing.assert_close(empirical, torch.tensor([0.1, 0.05, 0.0]), atol=3e-3, rtol=0)


def test_memory_bank_variance_and_threshold() -> None:
    """s: variance of each ℓ2-normalised column (torch's unbiased estimate, as numpy ddof=1);
    the variance noise is ε_var (1 − s̄) on dimensions with s < κ and 0 elsewhere."""
    bank = torch.tensor([[1.0, 0.0, 2.0], [1.0, 1.0, 0.0], [1.0, 3.0, 1.0], [1.0, 0.0, 0.0]])
    array = bank.numpy()
    normalised = array / np.linalg.norm(array, axis=0, keepdims=True)
    expected = normalised.var(axis=0, ddof=1)
    variance = column_variance(bank)
    np.testing.assert_allclose(variance.numpy(), expected, rtol=1e-6)
    assert float(variance[0]) == pytest.approx(0.0, abs=1e-7)  # a constant column
    assert (variance <= 1 / (len(bank) - 1) + 1e-7).all()  # the bound that makes κ inactive

    kappa = float(np.sort(expected)[1]) + 1e-4  # the two lowest-variance dims are below κ
    _, std_var = noise_std(None, variance, epsilon_g=0.1, epsilon_var=0.05, kappa=kappa)
    normed = (expected - expected.min()) / (expected.max() - expected.min())
    wanted = np.where(expected < kappa, 0.05 * (1 - normed), 0.0)
    np.testing.assert_allclose(std_var.numpy(), wanted, rtol=1e-5, atol=1e-8)
    assert float(std_var[0]) == pytest.approx(0.05)  # lowest variance: the full ε_var
    assert int((std_var > 0).sum()) == 2
    with pytest.raises(ValueError, match="at least 2"):
        column_variance(bank[:1])


def test_memory_bank_is_a_raw_fifo_that_checkpoints() -> None:
    """FGVR's bank keeps raw (unnormalised) feature vectors, oldest replaced first, and its
    rows, indices and pointer travel in the state dict."""
    bank = FeatureQueue(5, 2, normalize=False)
    assert bank.filled().shape == (0, 2)
    bank.enqueue(torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1, 2]))
    bank.enqueue(torch.tensor([[5.0, 5.0], [6.0, 6.0], [7.0, 7.0]]), torch.tensor([3, 4, 5]))
    torch.testing.assert_close(bank.filled(), torch.tensor(
        [[7.0, 7.0], [1.0, 0.0], [0.0, 2.0], [5.0, 5.0], [6.0, 6.0]]))
    restored = FeatureQueue(5, 2, normalize=False)
    restored.load_state_dict(bank.state_dict())
    torch.testing.assert_close(restored.filled(), bank.filled())
    assert int(restored.pointer) == 1


@pytest.mark.parametrize("mode", ["both", "gradcam", "low_variance", "random"])
def test_ablation_switches_choose_the_noise(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    method = build_method(make_cfg(perturbation=mode, kappa=1.0), in_channels=3)
    assert isinstance(method, FGVR)
    calls = []
    monkeypatch.setattr("raycl.methods.fgvr.gradcam_scores",
                        lambda *args, **kwargs: calls.append(1) or torch.full((8, 32), 0.5))
    method.memory.enqueue(torch.randn(8, 32), torch.arange(8))
    features = torch.randn(8, 32)
    std_g, std_var = method._noise_std(features,
                                       *method._criteria(features, make_batch().views[1]))
    assert (std_g is not None) == (mode in ("both", "gradcam", "random"))
    assert (std_var is not None) == (mode in ("both", "low_variance", "random"))
    assert bool(calls) == (mode in ("both", "gradcam"))
    if mode == "random":  # every dimension, the full noise
        assert torch.all(std_g == 0.1) and torch.all(std_var == 0.05)


# ---------------------------------------------------------------- the method


def test_decoder_is_sized_from_the_dataset() -> None:
    assert upsampling_plan(32) == (4, 3)
    assert upsampling_plan(224) == (7, 5)
    assert upsampling_plan(28) == (7, 2)
    assert upsampling_plan(16) == (4, 2)
    for channels, resolution in ((3, 32), (1, 28), (3, 64)):
        decoder = FeatureDecoder(feature_dim=12, channels=channels, resolution=resolution)
        assert decoder(torch.randn(2, 12)).shape == (2, channels, resolution, resolution)


def test_losses_and_what_is_detached() -> None:
    """L = L_C + α L_R + ν L_Cp; the decoder learns from L_R only (both reconstructions are
    detached in L_Cp), the encoder from all three."""
    torch.manual_seed(0)
    method = build_method(make_cfg(), in_channels=3)
    method.set_phase("train")
    outputs = method(make_batch())
    expected = (outputs["contrastive_loss"] + 1.0 * outputs["reconstruction_loss"]
                + 0.5 * outputs["pair_loss"])
    assert float(outputs["loss"]) == pytest.approx(float(expected), rel=1e-5)
    assert 0 < float(outputs["perturbation_norm"]) < 1
    assert int(method.memory.pointer) == 8  # the clean images' features went into the bank

    torch.manual_seed(0)
    no_reconstruction = build_method(make_cfg(alpha=0.0), in_channels=3)
    no_reconstruction.set_phase("train")
    no_reconstruction(make_batch())["loss"].backward()
    assert all(p.grad is None or not p.grad.any() for p in no_reconstruction.decoder.parameters())
    assert any(p.grad is not None and p.grad.any()
               for p in no_reconstruction.backbone.parameters())
    base = no_reconstruction.base
    assert isinstance(base, MoCoV2)
    assert all(p.grad is None for p in base.key_backbone.parameters())


def test_decoder_phase_freezes_the_encoder() -> None:
    """Phase "decoder": only the decoder trains (its own AdamW at fgvr.decoder_lr, constant),
    MSE on clean images; "train" restores what the base trains (MoCo's key encoder stays
    frozen)."""
    cfg = make_cfg(decoder_lr=1e-2)
    assert [(p.name, p.epochs, p.lr) for p in stage_phases(cfg)] == [
        ("decoder", 1, 1e-2), ("train", None, None)]
    method = build_method(cfg, in_channels=3)
    method.set_phase("decoder")
    optimizer = build_optimizer(method, cfg, stage_phases(cfg)[0])
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.param_groups[0]["lr"] == 1e-2
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for p in method.decoder.parameters()}
    encoder = {k: v.clone() for k, v in method.base.state_dict().items()}
    decoder = [p.clone() for p in method.decoder.parameters()]
    batch = make_batch()
    outputs = method(batch)
    assert set(outputs) == {"loss", "reconstruction_loss"}
    optimizer.zero_grad()
    outputs["loss"].backward()
    optimizer.step()
    for key, value in method.base.state_dict().items():
        if "running" not in key and "num_batches" not in key:  # BN statistics are buffers
            torch.testing.assert_close(value, encoder[key], msg=key)
    assert any(not torch.equal(a, b) for a, b in zip(decoder, method.decoder.parameters(),
                                                       strict=True))
    method.set_phase("train")
    assert all(p.requires_grad for p in method.backbone.parameters())
    assert not any(p.requires_grad for p in method.base.key_backbone.parameters())
    with pytest.raises(ValueError, match="unknown phase"):
        method.set_phase("min-max")


def test_phases_count_in_the_reports(tmp_path: Path) -> None:
    """ASHA's max_t counts the decoder epochs too (also a searched value), and 0 skips it."""
    assert stage_epochs(make_cfg(decoder_epochs=3)) == 3 + 10
    assert [p.name for p in stage_phases(make_cfg(decoder_epochs=0))] == ["train"]
    text = ("name: t\nmethod: fgvr\ntrain: {epochs: 4}\nfgvr: {decoder_epochs: 2}\n"
            "tune: {num_samples: 2, search_space: {fgvr.decoder_epochs: {choice: [1, 3]}}}\n")
    assert max_reports(load_search(write(tmp_path, text))) == 3 + 4
    message = error_of(tmp_path, "name: t\nmethod: fgvr\nfgvr: {base: simclr}\n")
    assert message.startswith(f"{tmp_path / 'search.yaml'}: fgvr.base: ")


def test_diagnostic_pictures(tmp_path: Path) -> None:
    method = build_method(make_cfg(), in_channels=3)
    method.set_phase("train")
    method(make_batch())
    method.eval()
    arrays = method.diagnostic_arrays(make_batch(4))
    assert arrays["fgvr_triples"].shape == (4, 3, 3, 16, 16)
    assert arrays["fgvr_triples"].dtype == np.uint8
    assert arrays["fgvr_gradcam_scores"].shape == (4, 32)
    assert arrays["fgvr_variance"].shape == (32,)
    written = method_figures(arrays, tmp_path, "t")
    assert [p.name for p in written] == ["fgvr_triples.png", "fgvr_scores.png"]
    assert all(p.stat().st_size > 1000 for p in written)


# ---------------------------------------------------------------- resuming in the right phase

FGVR_RUN = {"method": "fgvr", "fgvr": {"memory_size": 256, "decoder_epochs": 2,
                                       "decoder_width": 8, "decoder_lr": 1e-3},
            "mocov2": {"queue_size": 256}}


@pytest.fixture(scope="module")
def fgvr_reference(data_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> StoredSession:
    """One uninterrupted FGVR trial, the reference every interrupted one must end equal to
    (trained once for the module: it is the slowest part of these tests)."""
    return run(tmp_path_factory.mktemp("fgvr-reference"), extra=FGVR_RUN, epochs=2)


@pytest.mark.xdist_group("fgvr-reference")  # one test worker, so the reference is trained once
@pytest.mark.parametrize("crash_after", [1, 2, 3], ids=["in-decoder-phase", "at-the-boundary",
                                                        "in-train-phase"])
def test_interrupted_fgvr_resumes_in_the_right_phase(
    fgvr_reference: StoredSession, tmp_path: Path, crash_after: int
) -> None:
    """Killed after stage epoch 1 (inside the decoder phase), 2 (its last epoch) or 3 (the
    first joint epoch) and resumed: the trial goes on in the right phase at the right epoch and
    ends with exactly the numbers of an uninterrupted run."""
    reference = fgvr_reference
    phases = [(r["phase"], r["epoch"], r["global_epoch"]) for r in reference.reports]
    assert phases == [("decoder", 1, 1), ("decoder", 2, 2), ("train", 1, 3), ("train", 2, 4)]
    assert "val/linear/mean" not in reference.reports[0]  # the encoder has not changed yet
    assert reference.reports[1]["train/reconstruction_loss"] < \
        reference.reports[0]["train/reconstruction_loss"]

    root = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected fault"):
        run(root, fault={"after_epoch": crash_after, "marker": str(tmp_path / "crashed")},
            extra=FGVR_RUN, epochs=2)
    resumed = run(root, extra=FGVR_RUN, epochs=2)
    assert [(r["phase"], r["epoch"], r["global_epoch"]) for r in resumed.reports] == \
        phases[crash_after:]
    final = resumed.reports[-1]
    for key in ("train/loss", "train/pair_loss", "train/reconstruction_loss", "val/linear/mean",
                "test/linear/mean"):
        assert final[key] == pytest.approx(reference.reports[-1][key], abs=1e-6), key
