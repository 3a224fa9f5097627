"""The confirmed answer of a sweep, read back from its parent run: the ``confirm.csv`` artifact
(mean and 95 % interval over seeds of each configuration, best validation mean first) and the
``raycl.confirm_separation`` tag (the verdict), as the lines ``python -m raycl.leaderboard``
prints before the search's table (:func:`confirmed_answer_lines`).

Whatever wrote ``confirm.csv`` (seed confirmation, :mod:`raycl.sweep.confirm_tuner`, or the
seed repeats of an empty search space), its columns are those of
:func:`raycl.sweep.confirmation.confirm_table`; this module reads only the file and the tags.
"""

from __future__ import annotations

import csv
import math
import os
import tempfile
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raycl.config.sweep import resolve_tracking_uri
from raycl.sweep.confirmation import CSV_NAME, DELTA, confirm_lines
from raycl.tracking.runs import CONFIRMED_RUN_TAG, ROLE_TAG, mlflow_client
from raycl.tracking.terminal_table import terminal_width

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

# The parent run's verdict sentence (raycl.sweep.confirm_tuner.report_confirmation), and the
# one-line answer of seed repeats (raycl.sweep.repeats), shown where there is no verdict.
SEPARATION_TAG = "raycl.confirm_separation"
REPEATS_TAG = "raycl.repeats"


def _cell(text: str) -> Any:
    """A ``confirm.csv`` cell as :func:`confirm_table` made it: an int, a float (an empty cell:
    NaN, what :func:`~raycl.sweep.confirmation.write_confirm_csv` writes NaN as), or text."""
    if text == "":
        return float("nan")
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def read_confirm_csv(client: MlflowClient, run_id: str
                     ) -> tuple[list[str], list[list[Any]]] | None:
    """The ``confirm.csv`` artifact of the run ``run_id`` as ``(header, rows)`` (cells typed
    back: :func:`_cell`); None when the run has none."""
    if not any(item.path == CSV_NAME for item in client.list_artifacts(run_id)):
        return None
    # No progress bar on stderr for one small file (a setting of the user's is kept).
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    with tempfile.TemporaryDirectory() as directory:
        path = client.download_artifacts(run_id, CSV_NAME, directory)
        with Path(path).open(newline="") as handle:
            table = list(csv.reader(handle))
    if not table:
        return None
    return table[0], [[_cell(text) for text in row] for row in table[1:]]


def _without_empty_differences(header: list[str], rows: list[list[Any]]
                               ) -> tuple[list[str], list[list[Any]]]:
    """``confirm.csv`` without its difference-from-the-winner columns where no row has one (one
    configuration: seed repeats, or a confirmation of one)."""
    keep = [i for i, name in enumerate(header) if not name.startswith(DELTA) or any(
        not (isinstance(row[i], float) and math.isnan(row[i])) for row in rows)]
    return [header[i] for i in keep], [[row[i] for i in keep] for row in rows]


def latest_sweep(client: MlflowClient, experiment: str) -> Run | None:
    """The most recent parent run (``raycl.role = sweep``) of ``experiment``; None when the
    experiment or its sweep does not exist."""
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    runs = client.search_runs([found.experiment_id], f"tags.`{ROLE_TAG}` = 'sweep'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def confirmed_answer_lines(client: MlflowClient, parent: Run) -> list[str]:
    """The sweep's confirmed answer, headed as such: the confirmation's table
    (:func:`~raycl.sweep.confirmation.confirm_lines`), its verdict (seed repeats: their
    one-line answer), and the search trial
    ``--trial best`` names (when the parent names the confirmed winner); then a line that says
    the table below is the search's. Empty when the sweep wrote no ``confirm.csv``.

    Args:
        client: the sweep's MLflow store.
        parent: the sweep's parent run.
    """
    table = read_confirm_csv(client, parent.info.run_id)
    if table is None:
        return []
    header, rows = _without_empty_differences(*table)
    winner = parent.data.tags.get(CONFIRMED_RUN_TAG)
    # Named only when the parent says which search trial won: seed repeats confirm no choice.
    named = ""
    if winner:
        named = f"; `--trial best` names its winner: {client.get_run(winner).info.run_name}"
    lines = [f"Confirmed answer (mean and 95 % interval over seeds{named}):"]
    sentence = parent.data.tags.get(SEPARATION_TAG) or parent.data.tags.get(REPEATS_TAG)
    lines += confirm_lines(header, rows, sentence)[1:]  # its own title: the heading says it
    lines += ["", "The search (one seed per trial; read the confirmed answer above first):"]
    return lines


def print_confirmed_answer(tracking_uri: str, experiment: str) -> None:
    """Print :func:`confirmed_answer_lines` of ``experiment``'s latest sweep (nothing when it
    ran no confirmation, or when there is no such sweep: the leaderboard says so)."""
    uri = resolve_tracking_uri(tracking_uri)
    database = uri.removeprefix("sqlite:///")
    if database != uri and not Path(database).is_file():
        return  # no store yet (MLflow would create it): the leaderboard says what is missing
    client = mlflow_client(uri)
    parent = latest_sweep(client, experiment)
    width = max(terminal_width(), 40)
    for line in confirmed_answer_lines(client, parent) if parent is not None else []:
        # The table's rows (indented) as they are; the heading and the verdict wrapped.
        print(line if line.startswith("  ") else textwrap.fill(line, width=width) or line)


__all__ = ["REPEATS_TAG", "SEPARATION_TAG", "confirmed_answer_lines", "latest_sweep",
           "print_confirmed_answer", "read_confirm_csv"]
