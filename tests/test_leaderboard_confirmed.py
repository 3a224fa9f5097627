"""The leaderboard after seed confirmation (issue 47): it leads with the confirmed answer (the
parent's ``confirm.csv`` and verdict, and the trial ``--trial best`` names), the parent's
description names the MLflow search filters that show and hide the confirmation's runs, and a
trial's name stays readable at 80 columns with the objective and its test counterpart kept.

No Ray: the sweep's MLflow runs are written by hand with the tags, metrics and artifacts raycl
writes (:mod:`raycl.tracking.callback`, :mod:`raycl.sweep.confirm_tuner`).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from raycl.config.metric_names import baseline_metric
from raycl.leaderboard import main as leaderboard_main
from raycl.sweep.confirm_tuner import describe_confirmation
from raycl.sweep.confirmation import (
    CONFIRM_TAG,
    CSV_NAME,
    Confirmed,
    confirm_lines,
    confirm_table,
    separation_sentence,
    write_confirm_csv,
)
from raycl.tracking.confirm_summary import REPEATS_TAG, SEPARATION_TAG
from raycl.tracking.runs import (
    CONFIRMED_RUN_TAG,
    ENDED_TAG,
    NOTE_TAG,
    PARENT_TAG,
    ROLE_TAG,
    SEARCHED_TAG,
    TRIAL_TAG,
    get_or_create_experiment,
    mlflow_client,
)

OBJECTIVE, TEST = "val/linear/mean", "test/linear/mean"
REPEATED_ANSWER = "val/linear/mean 0.61 [0.5852, 0.6348] (95 %) over 3 of 3 planned seeds"
# Names as raycl.tracking.naming writes them for a search over method, HSCL's filter exponent
# and the learning rate; their searched values (raycl.searched) at full precision.
TRIALS = [
    ("t01 method=simclr lr=0.0026", "method=simclr, train.lr=0.002551", 0.71, 0.69),
    ("t02 method=hscl p=0.12 lr=0.0041",
     "method=hscl, hscl.filter_exponent=0.1234, train.lr=0.004123", 0.74, 0.70),
    ("t03 method=hscl p=0.31 lr=0.0012",
     "method=hscl, hscl.filter_exponent=0.3123, train.lr=0.001234", 0.78, 0.75),
]


def _sweep(client, uri: str, experiment: str) -> tuple[str, str, dict[str, str]]:
    """A finished search (:data:`TRIALS`); returns (experiment id, parent run id, name -> run
    id)."""
    experiment_id = get_or_create_experiment(client, experiment, uri)
    parent = client.create_run(experiment_id, run_name=experiment, tags={
        ROLE_TAG: "sweep", "raycl.metric": OBJECTIVE, "raycl.mode": "max"}).info.run_id
    client.log_metric(parent, baseline_metric(OBJECTIVE), 0.41)  # the "at init" row
    runs = {}
    for name, searched, val, test in TRIALS:
        run_id = client.create_run(experiment_id, run_name=name, tags={
            ROLE_TAG: "trial", PARENT_TAG: parent, TRIAL_TAG: name[:3], SEARCHED_TAG: searched,
            ENDED_TAG: "completed"}).info.run_id
        for key, value in {OBJECTIVE: val, TEST: test, "diag/effective_rank": 31.5,
                           "val/linear/shape": 0.9}.items():
            client.log_metric(run_id, key, value, step=4)
        client.set_terminated(run_id)
        runs[name] = run_id
    return experiment_id, parent, runs


def _confirmed_items() -> list[Confirmed]:
    """Two configurations confirmed over the same three seeds: t02's won, t03's (the search's
    best) came second."""
    seeds = [10000, 10001, 10002]
    first = Confirmed(1, {"method": "hscl", "hscl.filter_exponent": 0.3123}, seeds)
    second = Confirmed(2, {"method": "hscl", "hscl.filter_exponent": 0.1234}, seeds)
    for seed, (mine, theirs) in zip(seeds, [(0.75, 0.77), (0.76, 0.79), (0.74, 0.78)],
                                    strict=True):
        first.add(seed, mine, mine - 0.03)
        second.add(seed, theirs, theirs - 0.03)
    return [first, second]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Experiments ``confirmed`` (a search, then seed confirmation: confirm.csv, the verdict
    tag, the confirmed winner t02, and confirmation runs tagged raycl.confirm), ``repeated``
    (confirm.csv alone, as seed repeats write it) and ``searched`` (no confirmation)."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('confirmed') / 'mlflow.db'}"
    client = mlflow_client(uri)
    experiment_id, parent, runs = _sweep(client, uri, "confirmed")
    items = _confirmed_items()
    header, rows = confirm_table(items, OBJECTIVE, TEST, "max")
    with tempfile.TemporaryDirectory() as directory:
        write_confirm_csv(header, rows, Path(directory, CSV_NAME))
        client.log_artifact(parent, str(Path(directory, CSV_NAME)))
        # Seed repeats' confirm.csv: one configuration (no searched keys), no verdict.
        repeats = Confirmed(1, {}, [0, 1, 2])
        for seed, value in enumerate((0.60, 0.62, 0.61)):
            repeats.add(seed, value, value - 0.02)
        _, repeated, _ = _sweep(client, uri, "repeated")
        write_confirm_csv(*confirm_table([repeats], OBJECTIVE, TEST, "max"),
                          Path(directory, CSV_NAME))
        client.log_artifact(repeated, str(Path(directory, CSV_NAME)))
        client.set_tag(repeated, REPEATS_TAG, REPEATED_ANSWER)
    client.set_tag(parent, SEPARATION_TAG, separation_sentence(items, "max"))
    client.set_tag(parent, CONFIRMED_RUN_TAG, runs[TRIALS[1][0]])
    for rank, item in enumerate(items, start=1):
        for seed in item.seeds:
            client.create_run(experiment_id, run_name=f"c{rank} seed={seed}", tags={
                ROLE_TAG: "trial", PARENT_TAG: parent, CONFIRM_TAG: str(rank),
                TRIAL_TAG: f"c{rank}-{seed}"})
    _sweep(client, uri, "searched")
    return uri


def _printed(capsys: pytest.CaptureFixture[str], uri: str, experiment: str) -> list[str]:
    assert leaderboard_main(["--experiment", experiment, "--tracking-uri", uri]) == 0
    return capsys.readouterr().out.splitlines()


def test_the_leaderboard_leads_with_the_confirmed_answer(
        store: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")  # the heading and the verdict on one line each
    lines = _printed(capsys, store, "confirmed")
    items = _confirmed_items()
    header, rows = confirm_table(items, OBJECTIVE, TEST, "max")
    verdict = separation_sentence(items, "max")
    assert verdict is not None and verdict.startswith("the winner #2 (method=hscl, ")
    # As the sweep printed it at its end: the same table, read back from confirm.csv.
    block = confirm_lines(header, rows, verdict)[1:]  # under the heading, not its own title
    assert lines[0] == ("Confirmed answer (mean and 95 % interval over seeds; `--trial best` "
                        "names its winner: t02 method=hscl p=0.12 lr=0.0041):")
    assert lines[1:1 + len(block)] == block
    assert lines[1 + len(block):3 + len(block)] == [
        "", "The search (one seed per trial; read the confirmed answer above first):"]
    # Then the search's table, as before.
    search = lines.index(next(line for line in lines if line.startswith("#  trial")))
    assert search > 3 + len(block)
    assert lines[3 + len(block)].startswith("confirmed: 3 trial(s), best 10 by")


def test_any_confirm_csv_leads_and_a_sweep_without_one_does_not(
        store: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    # confirm.csv as seed repeats write it (raycl.sweep.repeats: one configuration, their
    # one-line answer as the tag raycl.repeats): read the same; no winner claimed.
    lines = _printed(capsys, store, "repeated")
    assert lines[0] == "Confirmed answer (mean and 95 % interval over seeds):"
    # Its differences from a winner (none: one configuration) left out.
    assert lines[1].split() == ["rank", "seeds", "n", "dropped", f"{OBJECTIVE}", "(95", "%)",
                                f"{TEST}", "(95", "%)"]
    assert lines[2].split()[:5] == ["1", "0", "1", "2", "3"]
    assert lines[3] == REPEATED_ANSWER
    lines = _printed(capsys, store, "searched")
    assert lines[0].startswith("searched: 3 trial(s), best 10 by")
    assert not any("Confirmed answer" in line for line in lines)


def test_the_description_names_filters_that_show_and_hide_the_confirmation_runs(
        store: str) -> None:
    client = mlflow_client(store)
    experiment = client.get_experiment_by_name("confirmed").experiment_id
    (parent,) = client.search_runs([experiment], f"tags.`{ROLE_TAG}` = 'sweep'")
    client.set_tag(parent.info.run_id, NOTE_TAG, "the search's leaderboard")
    describe_confirmation(client, parent.info.run_id, ["seed confirmation (…):"])
    # Written twice (a resumed confirmation): the answer leads once, the search's text below.
    describe_confirmation(client, parent.info.run_id, ["seed confirmation (…):"])
    note = client.get_run(parent.info.run_id).data.tags[NOTE_TAG]
    assert note.startswith("**Seed confirmation**") and note.count("Seed confirmation") == 1
    assert note.endswith("the search's leaderboard")
    show, hide = re.findall(r"`(tags\.[^`]+)`", note)
    confirmation = {run.info.run_id for run in client.search_runs([experiment], show)}
    others = {run.info.run_id for run in client.search_runs([experiment], hide)}
    every = {run.info.run_id for run in client.search_runs([experiment], "")}
    tagged = {run.info.run_id for run in client.search_runs([experiment], "")
              if CONFIRM_TAG in run.data.tags}
    assert len(tagged) == 6 and confirmation == tagged
    assert others == every - tagged and parent.info.run_id in others


def test_a_trials_name_stays_readable_at_80_columns_beside_objective_and_test(
        store: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole name does not fit beside the objective, its test counterpart and the searched
    keys: it shows its number (``t03``), the searched values whole in their own columns;
    nothing is cut in the middle of a value and the test column stays."""
    monkeypatch.setenv("COLUMNS", "80")
    lines = _printed(capsys, store, "searched")
    start = next(i for i, line in enumerate(lines) if line.startswith("#  trial"))
    table = lines[start:start + 2 + len(TRIALS)]
    assert all(len(line) <= 80 for line in table)
    # The untrained backbone's row: its status says what it is, its name cut if need be.
    assert lines[start + 2 + len(TRIALS)].split()[:4] == ["-", "at", "i…", "baseline"]
    head = table[0]
    assert head.split()[:5] == ["#", "trial", "status", OBJECTIVE, TEST]
    columns = [match.start() for match in re.finditer(r"\S+", head)]
    titles = head.split()

    def cells(line: str) -> dict[str, str]:
        ends = [*columns[1:], len(line) + 2]
        return {title: line[begin:end].strip()
                for title, begin, end in zip(titles, columns, ends, strict=True)}

    for line in table[2:]:
        row = cells(line)
        name, searched, _, _ = next(trial for trial in TRIALS
                                    if trial[0].split()[0] == row["trial"].split()[0])
        assert row["trial"] in (name, name.split()[0], f"{name.split()[0]} …"), row
        values = dict(pair.split("=") for pair in searched.split(", "))
        shown = {title: row[title] for title in titles[5:]}
        # Each searched value whole in its column (headers may be shortened: filter_exponent).
        assert sorted(v for v in shown.values() if v != "-") == sorted(
            f"{float(v):.4g}" if v[0].isdigit() else v for v in values.values()), (line, shown)
        assert "…" not in line.replace(f"{name.split()[0]} …", "")
    # Wide enough, the whole name.
    monkeypatch.setenv("COLUMNS", "120")
    wide = _printed(capsys, store, "searched")
    assert any(line.startswith(f"1  {TRIALS[2][0]}  completed") for line in wide)
    assert any(line.startswith("-  at init") for line in wide)
