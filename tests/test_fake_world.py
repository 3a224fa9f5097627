"""The fake worlds' start method (tests/fake_world.py): fork only where a forked rank can run a
backward. Checked in a fresh interpreter, since the case it guards against (autograd's device
threads started after a fake tensor was used, as torch.export does) cannot be undone in this
test process and would make every later fake world here spawn."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SCRIPT = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from fake_world import _start_method
print(_start_method())
with FakeTensorMode():
    torch.zeros(2)
torch.ones(3, requires_grad=True).sum().backward()
print(_start_method())
"""


def test_a_process_whose_autograd_cannot_fork_spawns_its_ranks() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.split() == ["fork", "spawn"]
    assert "Traceback" not in done.stderr  # the probe's own failure is silent
