"""The papers' linear evaluation (eval.linear_sgd, issue 34): SGD heads on a frozen backbone,
the learning rate chosen on validation, the test split read once after that choice. Its run
through Ray and MLflow is on tests/test_end_to_end.py's one-epoch quickstart sweep."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from fake_world import run_fake_world
from pydantic import ValidationError
from torch import nn

from raycl.config.evaluation import LinearSGDConfig
from raycl.config.metric_names import parse_metric
from raycl.config.sweep import TuneSection, reported_test_metric
from raycl.eval.label_fractions import label_fraction_subset
from raycl.eval.linear_sgd import (
    FrozenEncoder,
    LabelledImages,
    evaluate_linear_sgd,
    linear_sgd_metrics,
    milestone_factor,
    score_heads,
    select_by_validation,
    train_heads,
)
from raycl.launch.linear_sgd_check import check_linear_sgd
from raycl.methods import SearchConfig

CPU = torch.device("cpu")


def pixel_problem(count: int, seed: int, side: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """uint8 (count, 1, side, side) images whose first pixel is 0 or 255 and says the label;
    the other pixels are noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, count)
    images = rng.integers(0, 256, (count, 1, side, side)).astype(np.uint8)
    images[:, 0, 0, 0] = np.where(labels == 1, 255, 0)
    return images, labels.astype(np.int64)


def flat_encoder() -> FrozenEncoder:
    """A 'backbone' whose features are the pixels (with a BatchNorm that must stay frozen)."""
    model = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(4, affine=False))
    return FrozenEncoder(model=model, embed=model)


class ReadLog:
    """Images that note each read of them in a shared log."""

    def __init__(self, images: np.ndarray, name: str, log: list[str]) -> None:
        self.images, self.name, self.log = images, name, log

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        self.log.append(self.name)
        return self.images[rows]


def test_learning_rate_is_chosen_on_validation_and_test_is_read_once_after() -> None:
    """lr 1e-6 does not learn, 1e38 diverges (NaN weights: every row wrong, the other heads
    untouched), 1.0 learns: validation (true labels) chooses 1.0, and the test
    split (labels flipped, where the untrained head would win) is scored with that head alone,
    read only after every validation read."""
    train_images, train_labels = pixel_problem(64, 0)
    val_images, val_labels = pixel_problem(40, 1)
    test_images, test_labels = pixel_problem(30, 2)
    log: list[str] = []

    def load_test() -> LabelledImages:
        log.append("load_test")
        return LabelledImages(ReadLog(test_images, "test", log), {"a": 1 - test_labels})

    encoder = flat_encoder()
    encoder.model.train()
    settings = LinearSGDConfig(epochs=4, batch_size=16, lrs=[1e-6, 1e38, 1.0],
                               augment=False)
    results = evaluate_linear_sgd(
        encoder, LabelledImages(train_images, {"a": train_labels}),
        LabelledImages(ReadLog(val_images, "val", log), {"a": val_labels}), load_test,
        {"a": 2}, settings, CPU, seed=0)
    result = results[None]
    assert result.val_by_lr[1.0]["a"] == 1.0
    assert result.val_by_lr[1e-6]["a"] < 0.9
    assert result.val_by_lr[1e38]["a"] == 0.0
    assert result.chosen_lr == {"a": 1.0}
    assert result.val == {"a": 1.0}
    assert result.test == {"a": 0.0}  # the chosen head, perfect on true labels, on flipped ones
    assert log.count("load_test") == 1
    first_test = log.index("load_test")
    assert "val" in log and "val" not in log[first_test:] and "test" not in log[:first_test]
    assert encoder.model.training  # its mode restored; its BatchNorm statistics never updated
    assert torch.equal(encoder.model[1].running_mean, torch.zeros(4))


def test_selection_keeps_the_first_rate_on_a_tie_and_each_attribute_its_own() -> None:
    scores = {30.0: {"shape": 0.5, "colour": 0.9}, 1.0: {"shape": 0.5, "colour": 0.95}}
    assert select_by_validation(scores) == {"shape": 30.0, "colour": 1.0}


def test_milestones_multiply_the_rate_by_a_tenth_from_their_epoch() -> None:
    # HSCL: 100 epochs, x0.1 at 60 and 80 (torch's MultiStepLR([60, 80]) stepped per epoch).
    assert [milestone_factor(epoch, 100, [0.6, 0.8]) for epoch in (0, 59, 60, 79, 80, 99)] \
        == pytest.approx([1.0, 1.0, 0.1, 0.1, 0.01, 0.01])
    assert milestone_factor(1, 2, []) == 1.0
    with pytest.raises(ValueError, match="epoch must be in"):
        milestone_factor(2, 2, [0.5])


def test_training_steps_at_the_scheduled_rate() -> None:
    """One row, momentum 0: the bias moves by lr × factor × its gradient each epoch, so after a
    milestone at half the epochs the second step is a tenth of the first."""
    images = np.zeros((1, 1, 2, 2), dtype=np.uint8)
    train = LabelledImages(images, {"a": np.array([1])})
    settings = LinearSGDConfig(epochs=2, batch_size=1, lrs=[0.5], momentum=0.0,
                               lr_milestones=[0.5], augment=False)
    one_epoch = LinearSGDConfig(epochs=1, batch_size=1, lrs=[0.5], momentum=0.0,
                                lr_milestones=[], augment=False)
    encoder = flat_encoder_of()
    first = train_heads(encoder, train, np.array([0]), {"a": 2}, one_epoch, CPU, 0)
    both = train_heads(encoder, train, np.array([0]), {"a": 2}, settings, CPU, 0)
    step1 = first.layers[0].bias.detach()  # from a zero bias
    # The second step's gradient at the first step's logits: softmax(b) - onehot(1).
    grad2 = torch.softmax(step1 + first.layers[0].weight.detach() @ torch.full((4,), -1.0),
                          dim=0) - torch.tensor([0.0, 1.0])
    assert torch.allclose(both.layers[0].bias.detach(), step1 - 0.05 * grad2, atol=1e-6)


def test_label_fraction_heads_learn_from_their_seeded_subset_only() -> None:
    """The images outside the seeded 50 % subset say the wrong class: the heads on every label
    learn noise, the 50 % heads the rule (so they saw exactly that subset)."""
    images, labels = pixel_problem(80, 3)
    subset = label_fraction_subset(labels, 0.5, seed=7)
    outside = np.setdiff1d(np.arange(len(labels)), subset)
    images[outside, 0, 0, 0] = 255 - images[outside, 0, 0, 0]
    val_images, val_labels = pixel_problem(40, 4)
    settings = LinearSGDConfig(epochs=6, batch_size=20, lrs=[1.0], augment=False,
                               label_fractions=[0.5])
    results = evaluate_linear_sgd(
        flat_encoder(), LabelledImages(images, {"a": labels}),
        LabelledImages(val_images, {"a": val_labels}),
        lambda: LabelledImages(val_images, {"a": val_labels}), {"a": 2}, settings, CPU, seed=7)
    assert results["50"].val["a"] == 1.0
    assert results[None].val["a"] < 0.8
    metrics = linear_sgd_metrics(results)
    assert metrics["val/linear_sgd_50pct/a"] == 1.0
    assert metrics["test/linear_sgd_50pct/mean"] == 1.0
    assert metrics["diag/linear_sgd_50pct_lr/a"] == 1.0
    assert {"val/linear_sgd/mean", "test/linear_sgd/a", "diag/linear_sgd_lr/a"} <= set(metrics)
    for key in metrics:
        assert parse_metric(key).format() == key


def test_metric_names_of_the_protocol_are_names_of_the_contract() -> None:
    """val/linear_sgd/... may be an objective (its test name is reported beside it); the label
    shares and the kept rate parse back."""
    assert parse_metric("val/linear_sgd_50pct/shape").percent == "50"
    assert parse_metric("val/linear_sgd_50pct/shape").family == "linear_sgd"
    assert parse_metric("diag/linear_sgd_lr/shape").split == "diag"
    assert TuneSection(metric="val/linear_sgd/mean").metric == "val/linear_sgd/mean"
    assert reported_test_metric("val/linear_sgd_20pct/mean") == "test/linear_sgd_20pct/mean"
    with pytest.raises(ValidationError, match="is a test metric"):
        TuneSection(metric="test/linear_sgd/mean")


@pytest.mark.parametrize(("settings", "key", "why"), [
    ({"method": "mcl", "mcl": {"stages": 2, "clusters": 2}}, "eval.linear_sgd",
     "not yet for MCL"),
    ({"data": {"dataset": "trifeature", "loader": "stream"}}, "eval.linear_sgd",
     "not yet for data.loader: stream"),
    ({"eval": {"linear_sgd": None}, "tune": {"metric": "val/linear_sgd/mean"}}, "tune.metric",
     "reported only with eval.linear_sgd set"),
])
def test_configs_the_protocol_does_not_cover_are_refused_before_launch(
    settings: dict, key: str, why: str
) -> None:
    raw: dict = {"name": "linear-sgd", "eval": {"linear_sgd": {"epochs": 1}}}
    for section, values in settings.items():
        raw[section] = {**raw.get(section, {}), **values} if isinstance(values, dict) else values
    problems = list(check_linear_sgd(SearchConfig.model_validate(raw)))
    assert [(problem.key, why in problem.why) for problem in problems] == [(key, True)]


def test_augmented_training_is_seeded_and_sees_other_pixels_than_the_whole_image() -> None:
    images, labels = pixel_problem(32, 5, side=8)
    train = LabelledImages(images, {"a": labels})

    def trained(augment: bool) -> torch.Tensor:
        settings = LinearSGDConfig(epochs=2, batch_size=8, lrs=[0.1, 0.01], augment=augment)
        heads = train_heads(flat_encoder_of(), train, np.arange(32), {"a": 2}, settings, CPU, 1)
        return heads.layers[1].weight.detach()

    assert torch.equal(trained(True), trained(True))
    assert not torch.allclose(trained(True), trained(False))


def flat_encoder_of() -> FrozenEncoder:
    """A 'backbone' whose features are the pixels."""
    model = nn.Flatten()
    return FrozenEncoder(model=model, embed=model)


# Two ranks: 25 rows in global batches of 10 (shares 5/5, and 3/2 in the last batch).
ROWS, BATCH = 25, 10


def _ddp_settings() -> LinearSGDConfig:
    return LinearSGDConfig(epochs=3, batch_size=BATCH, lrs=[0.3, 0.03], momentum=0.9,
                           weight_decay=1e-3, lr_milestones=[0.5], augment=False)


def _two_rank_worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        images, labels = pixel_problem(ROWS, 6)
        train = LabelledImages(images, {"a": labels, "b": labels % 2})
        heads = train_heads(flat_encoder(), train, np.arange(ROWS), {"a": 2, "b": 3},
                            _ddp_settings(), CPU, seed=4)
        scores = score_heads(flat_encoder(), heads, train, 4, CPU)
        torch.save({"heads": heads.state_dict(), "scores": scores}, Path(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_ranks_train_the_heads_of_one_rank_on_the_whole_batches(tmp_path: Path) -> None:
    run_fake_world(_two_rank_worker, (f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), 2)
    images, labels = pixel_problem(ROWS, 6)
    train = LabelledImages(images, {"a": labels, "b": labels % 2})
    alone = train_heads(flat_encoder(), train, np.arange(ROWS), {"a": 2, "b": 3},
                        _ddp_settings(), CPU, seed=4)
    alone_scores = score_heads(flat_encoder(), alone, train, 7, CPU)
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for key, value in alone.state_dict().items():
            assert torch.allclose(saved["heads"][key], value, atol=1e-6), (rank, key)
        np.testing.assert_allclose(saved["scores"], alone_scores)
