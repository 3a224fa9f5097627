"""Seed confirmation's data caches (raycl.sweep.confirm_caches): a confirmation seed's own
generated sets are removed once its trial has ended; what the search's seed shares stays.

No Ray: the removal's body runs here, and Ray's calls are stand-ins recording what they were
asked (the confirmation end to end is tests/test_confirm.py's quickstart)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from raycl.config.search_config import apply_overrides
from raycl.data import load_dataset
from raycl.eval.transfer import transfer_data_config
from raycl.launch.load import load_search
from raycl.sweep import confirm_caches
from raycl.sweep.confirm_caches import SeedCacheRemoval, remove_seed_caches, seed_data_configs
from raycl.sweep.confirmation import SEED_STRIDE

REPO = Path(__file__).resolve().parents[1]


def tiny_sweep(cache: Path, *overrides: str) -> Any:
    """The quickstart at 8 px and 1 000 images, its caches under ``cache``, a digits transfer
    set (also generated per seed), confirming over 2 seeds."""
    return load_search(REPO / "searches" / "quickstart.yaml", [
        "seed=0", f"data.cache_dir={cache}", "data.resolution=8",
        "data.samples_per_combination=1", "eval.transfer=[{dataset: digits}]",
        "tune.confirm={top_k: 1, seeds: 2}", *overrides])


def cached_sets(cache: Path) -> list[str]:
    return sorted(path.name.split("-")[0] for path in cache.iterdir()
                  if path.is_dir() and ".tmp-" not in path.name)


def test_a_confirmation_seeds_own_caches_are_removed_and_the_searchs_stay(
        tmp_path: Path) -> None:
    """Trifeature and digits are cached per seed: the seed's copies go, the search seed's
    stay; a second removal finds none; the lock files a build leaves stay."""
    cache = tmp_path / "cache"
    config = tiny_sweep(cache)
    seed = SEED_STRIDE  # rank 1's first confirmation seed of base seed 0
    for each in (config.seed, seed):  # as a trial of each seed loads its sets
        load_dataset(config.data, each)
        load_dataset(transfer_data_config(config, config.eval.transfer[0]), each)
    assert cached_sets(cache) == ["digits", "digits", "trifeature", "trifeature"]
    assert [cfg.dataset for cfg in seed_data_configs(config)] == ["trifeature", "digits"]

    removed = remove_seed_caches(seed_data_configs(config), seed, config.seed)
    assert len(removed) == 2 and all(Path(path).parent == cache for path in removed)
    assert cached_sets(cache) == ["digits", "trifeature"]
    assert load_dataset(config.data, config.seed).train.images.shape[0] > 0  # still there
    assert remove_seed_caches(seed_data_configs(config), seed, config.seed) == []
    assert len(list(cache.glob("*.lock"))) == 4


def test_a_set_not_keyed_by_the_seed_is_never_removed(tmp_path: Path) -> None:
    """A folder's cache is named by its listing (shared by every seed): not a candidate; an
    array set whose key ignores the seed would be the search's own copy: kept."""
    config = tiny_sweep(tmp_path / "cache")
    folder = config.model_copy(update={
        "data": config.data.model_copy(update={"dataset": "folder", "root": str(tmp_path)}),
        "eval": config.eval.model_copy(update={"transfer": []})})
    assert seed_data_configs(folder) == []
    # The same seed as the search's: the same directory, never removed.
    assert remove_seed_caches(seed_data_configs(config), config.seed, config.seed) == []


class FakeRay:
    """Ray's calls as far as SeedCacheRemoval uses them: each launch recorded, each task done."""

    def __init__(self) -> None:
        self.launched: list[tuple[list[str], int, int]] = []

    def launch(self, data_configs: list[Any], seed: int, base_seed: int) -> list[str]:
        self.launched.append(([cfg.dataset for cfg in data_configs], seed, base_seed))
        return [f"ref{len(self.launched)}"]


def test_the_callback_removes_each_ended_seeds_caches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeRay()
    monkeypatch.setattr(confirm_caches, "launch_removal", fake.launch)
    monkeypatch.setattr(ray, "wait", lambda refs, **kw: (list(refs), []))
    monkeypatch.setattr(ray, "get", lambda ref: [f"/cache/{ref}"])
    callback = SeedCacheRemoval(tiny_sweep(tmp_path / "cache"))
    completed = SimpleNamespace(config={"seed": SEED_STRIDE, "train.lr": 0.001})
    failed = SimpleNamespace(config={"seed": SEED_STRIDE + 1, "train.lr": 0.001})
    callback.on_trial_complete(0, [], completed)
    callback.on_trial_error(0, [], failed)
    assert fake.launched == [(["trifeature", "digits"], SEED_STRIDE, 0),
                             (["trifeature", "digits"], SEED_STRIDE + 1, 0)]
    assert callback.__getstate__()["_pending"] == []  # Tune's pickle: no driver's tasks
    assert callback.wait(1.0) == ["/cache/ref1", "/cache/ref2"]
    # The end: a seed that ended in an earlier driver (killed before its removal ran) too;
    # one removed here already, or still running (interrupted), is not launched again.
    earlier = SimpleNamespace(config={"seed": SEED_STRIDE + 2}, status="TERMINATED")
    running = SimpleNamespace(config={"seed": SEED_STRIDE + 3}, status="RUNNING")
    callback.on_experiment_end([SimpleNamespace(**vars(completed), status="TERMINATED"),
                                earlier, running])
    assert [seed for _, seed, _ in fake.launched] == [SEED_STRIDE + i for i in range(3)]

    def broken(*args: Any) -> list[str]:
        raise ConnectionError("no cluster")

    monkeypatch.setattr(confirm_caches, "launch_removal", broken)
    callback.on_trial_complete(0, [], completed)  # one warning, the confirmation goes on
    assert "were not removed: ConnectionError: no cluster" in capsys.readouterr().err


def test_a_seed_shared_by_two_configurations_is_removed_after_the_last_of_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Paired seeds (issue 47) with tune.confirm.redraw_data: configuration 1's seed s ending
    while configuration 2's seed s still trains must not remove the copy the latter reads."""
    fake = FakeRay()
    monkeypatch.setattr(confirm_caches, "launch_removal", fake.launch)
    callback = SeedCacheRemoval(tiny_sweep(tmp_path / "cache"))
    first = SimpleNamespace(config={"seed": SEED_STRIDE, "train.lr": 0.001}, status="RUNNING")
    second = SimpleNamespace(config={"seed": SEED_STRIDE, "train.lr": 0.002}, status="RUNNING")
    other = SimpleNamespace(config={"seed": SEED_STRIDE + 1, "train.lr": 0.002},
                            status="PENDING")
    callback.on_trial_complete(0, [first, second, other], first)
    assert fake.launched == []  # the second still reads seed SEED_STRIDE's copy
    first.status = "TERMINATED"
    callback.on_trial_complete(0, [first, second, other], second)
    assert [seed for _, seed, _ in fake.launched] == [SEED_STRIDE]


def test_confirmation_on_the_searchs_data_removes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """By default confirmation pins data.seed to the search's: its seeds own no copies."""
    fake = FakeRay()
    monkeypatch.setattr(confirm_caches, "launch_removal", fake.launch)
    pinned = apply_overrides(tiny_sweep(tmp_path / "cache"), {"data.seed": 0})
    callback = SeedCacheRemoval(pinned)
    ended = SimpleNamespace(config={"seed": SEED_STRIDE, "train.lr": 0.001}, status="RUNNING")
    callback.on_trial_complete(0, [ended], ended)
    assert fake.launched == []
