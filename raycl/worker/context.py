"""The trial's context: what the trial process hands its worker loop, once per trial.

:func:`raycl.trial.trainable.fit_trial` builds it; every Ray Train worker receives a copy (pickled
with the loop function) and :func:`raycl.worker.loop.run_trial_loop` reads it, as does the
in-process loop of ``scaling.num_workers: 0`` and of the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raycl.config.schema import CoreConfig
from raycl.config.search_config import search_config_class


@dataclass(frozen=True)
class TrialContext:
    """One trial's context, the same on every rank.

    Attributes:
        config: the trial's validated config (the search config with its method sections):
            the sampled parameters applied, ``data.loader`` as settled at launch, every path
            absolute.
        trial_id: Tune's trial id, which names the trial's MLflow run (the skipped-images
            artifact goes there); ``"local"`` outside Tune.
        started_at: ``time.time()`` when the trial began, on the trial process's clock:
            ``perf/startup_seconds`` counts from it. None: from when the loop starts.
        data_placement_group: hex id of a placement group whose bundle on each rank's node
            holds stream mode's decoders; None (what :func:`raycl.trial.trainable.fit_trial`
            passes): each rank's own bundle holds them (:func:`raycl.worker.stream_loader
            .decoder_bundle`).
    """

    config: CoreConfig
    trial_id: str = "local"
    started_at: float | None = None
    data_placement_group: str | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # To another process as plain data, validated again there: the search config's class
        # is built in each process from the method sections registered in it.
        return (_arrived, (self.config.to_dict(), self.trial_id, self.started_at,
                           self.data_placement_group))


def _arrived(config: dict[str, Any], trial_id: str, started_at: float | None,
             data_placement_group: str | None) -> TrialContext:
    """A :class:`TrialContext` unpickled: its config validated by this process's schema."""
    import raycl.methods  # noqa: F401  (its @register calls fill the schema's method sections)

    return TrialContext(config=search_config_class().model_validate(config), trial_id=trial_id,
                        started_at=started_at, data_placement_group=data_placement_group)


__all__ = ["TrialContext"]
