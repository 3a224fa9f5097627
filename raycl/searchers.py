"""Search algorithms, with the workarounds they need in one place."""

from __future__ import annotations

from ray.tune.search.optuna import OptunaSearch as _RayOptunaSearch


class OptunaSearch(_RayOptunaSearch):
    """Ray's ``OptunaSearch`` that ignores reports without the objective.

    Ray 2.60's ``OptunaSearch.on_trial_result`` indexes ``result[metric]`` unconditionally
    (ray/tune/search/optuna/optuna_search.py; no upstream issue found) and the KeyError kills the
    whole sweep on the first report without the objective: an epoch without evaluation
    (``eval.every_n_epochs > 1``) or an MCL trial skipped for its budget. Such reports carry
    nothing for Optuna, so they are skipped; completion (``on_trial_complete``) already handles a
    missing metric by recording the trial as pruned.
    """

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if self.metric in result:
            super().on_trial_result(trial_id, result)
