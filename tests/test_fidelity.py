"""``benchmarks/fidelity.py``: the verdict rule and the paired interval on hand-made numbers,
every arm of every claim a valid config at every scale, the paper files pointing at their row,
and one claim end to end on a process that cannot import Ray or MLflow (a bare GPU machine)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from script_modules import REPO, load_script

fidelity = load_script("benchmarks/fidelity.py", "fidelity_bench")

FIELDS = {"claim", "method", "baseline", "dataset", "metric", "split", "method_mean",
          "baseline_mean", "delta", "ci95", "seeds", "paper_delta", "verdict", "wall_s",
          "at_init_mean"}


@pytest.mark.parametrize(("low", "high", "paper", "expected"), [
    (0.01, 0.05, 0.04, "reproduced"),
    (-0.05, -0.01, 0.04, "opposite"),
    (-0.01, 0.02, 0.04, "inconclusive"),
    (0.0, 0.02, 0.04, "inconclusive"),  # touching 0 does not exclude it
    (-0.05, -0.01, -0.02, "reproduced"),  # a paper that reports a drop
    (0.01, 0.05, -0.02, "opposite"),
    (math.nan, math.nan, 0.04, "inconclusive"),  # one seed: no interval
])
def test_verdict_rule(low: float, high: float, paper: float, expected: str) -> None:
    assert fidelity.verdict(low, high, paper) == expected


def test_paired_interval_on_hand_computed_seeds() -> None:
    # Differences 0.05, 0.03, 0.04: mean 0.04, s = 0.01, t(0.975, 2) = 4.303 -> half width
    # 4.303 * 0.01 / sqrt(3) = 0.02484. The fourth seed failed on the baseline: left out.
    method = [(0.60, 0.70), (0.61, 0.72), (0.62, 0.74), (0.63, 0.75)]
    baseline = [(0.60, 0.65), (0.60, 0.69), (0.60, 0.70), (math.nan, math.nan)]
    line = fidelity.paired_summary([0, 1, 2, 3], method, baseline, paper_delta=0.04)
    assert line["delta"] == pytest.approx(0.04)
    assert line["ci95"] == pytest.approx([0.0152, 0.0648], abs=1e-4)
    assert line["verdict"] == "reproduced"
    assert line["method_mean"] == pytest.approx((0.70 + 0.72 + 0.74 + 0.75) / 4)
    assert line["baseline_mean"] == pytest.approx((0.65 + 0.69 + 0.70) / 3)
    # Validation: differences 0.00, 0.01, 0.02 -> mean 0.01, interval holds 0.
    assert line["val_delta"] == pytest.approx(0.01)
    assert line["val_ci95"][0] < 0 < line["val_ci95"][1]
    # Each seed's numbers, as measured (the failed seed's as None).
    assert line["method_values"] == [0.70, 0.72, 0.74, 0.75]
    assert line["baseline_val_values"] == [0.60, 0.60, 0.60, None]
    # Against a paper that reports a drop, the same interval is the opposite.
    assert fidelity.paired_summary([0, 1, 2, 3], method, baseline, -0.01)["verdict"] == \
        "opposite"


def test_every_arm_of_every_claim_is_a_valid_config_at_every_scale() -> None:
    from raycl.launch.load import load_search

    roots = {"cifar10": None, "cifar100": None, "fashion_mnist": None}
    for scale in fidelity.SCALES:
        settings = fidelity.scale_settings(scale)
        chosen = fidelity.claims(settings)
        assert len(chosen) == 5
        for claim in chosen:
            shared = [*fidelity.claim_overrides(claim, settings, roots), "data.seed=0",
                      "seed=1"]
            started = [f"{claim.pretrained_key}=/x/state.pt"] if claim.pretrain else []
            configs = [load_search(fidelity.SEARCHES / claim.search,
                                   [*shared, *started, *arm.overrides], check_references=False)
                       for arm in (claim.method, claim.baseline, *claim.others)]
            # Paired: the arms differ in the method and its sections only, never in the data.
            assert len({config.data.model_dump_json() for config in configs}) == 1, claim.name
            assert len({config.seed for config in configs}) == 1
            if claim.pretrain:
                load_search(fidelity.SEARCHES / claim.search, [*shared, *claim.pretrain],
                            check_references=False)


def test_each_paper_file_points_at_its_row_of_the_fidelity_table() -> None:
    names = {claim.name for claim in fidelity.claims(fidelity.scale_settings("quick"))}
    table = (REPO / "docs" / "benchmarks.md").read_text()
    assert "## Fidelity: each seed's claim" in table
    for path in sorted((REPO / "searches" / "papers").glob("*.yaml")):
        header = "".join(line for line in path.open() if line.startswith("#"))
        found = re.search(r"Fidelity: each seed's claim\", row (\w+)\.", header)
        assert found, f"{path.name}: no pointer to the fidelity table"
        assert found.group(1) in names, path.name
        assert f"| {found.group(1)} |" in table, f"{path.name}: no row {found.group(1)}"


# Imports of Ray or MLflow fail in the child, as on a GPU machine that has torch alone.
WITHOUT_RAY = """
import importlib.abc, sys
class NoRay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("ray", "mlflow"):
            raise ImportError(f"{name} is not installed here")
sys.meta_path.insert(0, NoRay())
sys.argv = ["fidelity.py", *sys.argv[1:]]
import runpy
runpy.run_path(%r, run_name="__main__")
"""


@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").is_dir(),
                    reason="Debian package dataset-fashion-mnist not installed")
def test_a_quick_claim_runs_without_ray_and_prints_its_json_line(tmp_path: Path) -> None:
    out = tmp_path / "fidelity.jsonl"
    script = WITHOUT_RAY % str(REPO / "benchmarks" / "fidelity.py")
    done = subprocess.run(
        [sys.executable, "-c", script, "--quick", "--claims", "all4one_nnclr",
         "--json-out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(text) for text in done.stdout.splitlines() if text.startswith("{")]
    assert len(lines) == 1 and json.loads(out.read_text()) == lines[0]
    line = lines[0]
    assert set(line) >= FIELDS, FIELDS - set(line)
    assert line["claim"] == "all4one_nnclr" and line["split"] == "test"
    assert line["seeds"] == [0, 1] and line["scale"] == "quick"
    assert line["verdict"] in {"reproduced", "opposite", "inconclusive"}
    assert all(0.0 <= value <= 1.0 for value in
               [*line["method_values"], *line["baseline_values"], line["at_init_mean"]])
    assert line["delta"] == pytest.approx(line["method_mean"] - line["baseline_mean"], abs=2e-4)
