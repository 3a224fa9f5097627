"""``benchmarks/gpu.py`` runs on a bare machine: torch and raycl's torch-level modules, no Ray,
no MLflow (both made unimportable here), end to end at its smoke-test size on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BLOCKED_RUN = """
import runpy, sys

class Absent:
    '''Ray and MLflow look uninstalled: any import of them fails as a missing module would.'''

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "mlflow"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, Absent())
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("ray", "mlflow"))
assert not loaded, loaded
"""


def test_gpu_benchmark_runs_without_ray_or_mlflow(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    result = subprocess.run(
        [sys.executable, "-c", BLOCKED_RUN, str(REPO / "benchmarks" / "gpu.py"), "--device",
         "cpu", "--quick", "--threads", "1", "--methods", "simclr", "mcl", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| training img/s, default" in result.stdout
    report = json.loads(out.read_text())
    default = report["training"][0]
    assert default["label"] == "default" and default["amp"] == "off"
    assert len(default["ratio"]) == 1 and default["ratio"][0] > 0
    assert set(report["methods"]) == {"simclr", "mcl"}
    assert all("step_seconds" in step for step in report["methods"].values())
    assert report["embedding"]["raycl_img_per_s"] and report["kmeans"]["cpu_seconds"]
    assert report["machine"]["device"] == "cpu"
