"""Ray Train's ``TorchTrainer`` without the Ray Data actor that a raycl trial never uses.

Ray Train 2.60's ``DatasetsCallback`` starts a ``DatasetManager`` actor at every start of a worker
group, whether the trainer was given datasets or not (brought back unconditionally by
ray-project/ray#63309; no upstream issue asks for it to be lazy yet). raycl feeds its workers
from its own loaders and passes no Ray Dataset, so each Train run (and each restart of its worker
group) paid for one more Python process that imports Ray Data and waits: ~2.5 s of CPU, which a
sweep of many short trials, and the test suite, pays per trial. Without datasets the callback
has nothing to do (``ray.train.get_dataset_shard`` raises a ``KeyError`` either way), so it is
left out; given datasets, the trainer is Ray's own.
"""

from __future__ import annotations

from typing import Any

from ray.train.torch import TorchTrainer

try:  # Ray's internal layout: where it moves, the trainer is simply Ray's own
    from ray.train.v2._internal.callbacks import DatasetsCallback
except ImportError:  # pragma: no cover - another Ray
    DatasetsCallback = None


class TorchTrainerWithoutDatasets(TorchTrainer):
    """``ray.train.torch.TorchTrainer`` that starts no ``DatasetManager`` actor when it was given
    no ``datasets`` (see the module docstring); otherwise exactly Ray's."""

    def _create_default_callbacks(self) -> list[Any]:
        callbacks = super()._create_default_callbacks()
        if self.datasets or DatasetsCallback is None:
            return callbacks
        return [callback for callback in callbacks if not isinstance(callback, DatasetsCallback)]


__all__ = ["TorchTrainerWithoutDatasets"]
