"""The shipped cluster configs are valid for the tools that read them."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

CLUSTERS = Path(__file__).resolve().parents[1] / "clusters"
LAUNCHER = sorted(p for p in CLUSTERS.glob("*.yaml") if "kind" not in yaml.safe_load(p.read_text()))


@pytest.mark.parametrize("path", LAUNCHER, ids=lambda p: p.name)
def test_launcher_configs_match_rays_schema(path: Path) -> None:
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(yaml.safe_load(path.read_text()), schema)


def test_kuberay_job_runs_raycl_tune() -> None:
    job = yaml.safe_load((CLUSTERS / "kuberay-rayjob.yaml").read_text())
    assert job["kind"] == "RayJob"
    assert job["spec"]["entrypoint"].startswith("python -m raycl.tune searches/")
    assert (CLUSTERS.parent / job["spec"]["entrypoint"].split()[3]).is_file()
