"""The pre-launch warning that rank 0's scoring leaves the cluster idle (issue 46, finding 7)."""

from __future__ import annotations

from typing import Any

from raycl.launch.eval_cost import evaluation_idle_warning, scored_rows
from raycl.methods import SearchConfig

IMAGENET = {"train": 1_153_050, "val": 128_117, "test": 50_000}


def config_of(workers: int, **evaluation: Any) -> Any:
    return SearchConfig.model_validate({"name": "idle", "eval": evaluation,
                                        "scaling": {"num_workers": workers}})


def test_uncapped_imagenet_on_64_workers_is_warned_of_with_what_to_set() -> None:
    warning = evaluation_idle_warning(config_of(64), IMAGENET)
    assert warning is not None
    assert "1,281,167 rows" in warning and "other 63 worker(s) wait" in warning
    assert "eval.max_train_samples" in warning and "eval.every_n_epochs" in warning
    # 1.28 M rows x 0.1 against 18 016 images per worker: about seven epochs' worth.
    assert "711%" in warning


def test_capped_sparse_small_or_end_only_evaluations_are_not() -> None:
    capped = config_of(64, max_train_samples=10_000, max_eval_samples=10_000)
    assert scored_rows(capped, IMAGENET) == 20_000
    assert evaluation_idle_warning(capped, IMAGENET) is None
    # Every 10 epochs, uncapped on 8 workers: 1.28 M x 0.1 / (10 x 144 131) = 9 %.
    assert evaluation_idle_warning(config_of(8, every_n_epochs=10), IMAGENET) is None
    # A small set: rank 0 scores in seconds, whatever the ratio ...
    small = {"train": 30_000, "val": 3_000, "test": 3_000}
    assert evaluation_idle_warning(config_of(64), small) is None
    # ... but CIFAR-10 on 64 workers (700 images each an epoch) is warned of.
    cifar = {"train": 45_000, "val": 5_000, "test": 10_000}
    assert evaluation_idle_warning(config_of(64), cifar) is not None
    assert evaluation_idle_warning(config_of(64, every_n_epochs=0), IMAGENET) is None
