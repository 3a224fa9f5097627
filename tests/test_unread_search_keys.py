"""Issue 47: a searched key that no trial reads (a method's knob no searched method uses) is
named in one notice before launch, beside the notice of a pinned searched key; a key some trials
read is not."""

from __future__ import annotations

from pathlib import Path

from raycl.launch.load import load_search

REPO = Path(__file__).resolve().parents[1]
SEARCHES = REPO / "searches"


def test_mcl_over_hscl_names_the_unread_simclr_temperature() -> None:
    path = SEARCHES / "mcl_k_n.yaml"
    notices: list[str] = []
    load_search(path, ["mcl.base=hscl"], notices=notices)
    assert f"{path}: tune.search_space.simclr.temperature is searched but no trial reads it " \
           f"(mcl.base=hscl); it is not sampled" in notices
    # MCL's own keys are read by every trial: no notice for them.
    assert not any("mcl.clusters" in line or "mcl.stages" in line for line in notices)
    # Over SimCLR (the file as written) every searched key is read.
    notices = []
    load_search(path, [], notices=notices)
    assert not any("no trial reads" in line for line in notices)


def test_a_knob_is_unread_unless_a_searched_method_reads_it() -> None:
    path = SEARCHES / "quickstart.yaml"  # method: simclr
    knob = "tune.search_space.hscl.filter_exponent={uniform: [0.0, 0.6]}"
    notices: list[str] = []
    load_search(path, [knob], check_references=False, notices=notices)
    assert [line for line in notices if "no trial reads" in line] == [
        f"{path}: tune.search_space.hscl.filter_exponent is searched but no trial reads it "
        f"(method=simclr); it is not sampled"]
    # Searched over methods, HSCL's trials read it: some trials only, not none.
    notices = []
    load_search(path, [knob, "tune.search_space.method={choice: [simclr, hscl]}"],
                check_references=False, notices=notices)
    assert not any("no trial reads" in line for line in notices)
