"""The suite collects the same test names every time: pytest-xdist's workers each collect the suite and refuse
to run when their lists differ, so a test name that depends on the clock (a gzip header's mtime), on hash
order or on randomness fails CI by chance. Two collections, a second or more apart, with other hash seeds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _collect(seed: str) -> list[str]:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                          "tests"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_two_collections_name_the_same_tests() -> None:
    first = _collect("1")  # collecting takes several seconds: the second one runs in another second
    second = _collect("2")
    assert len(first) > 1000
    assert first == second, sorted(set(first) ^ set(second))[:10]
