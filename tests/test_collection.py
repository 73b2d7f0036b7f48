"""The suite collects the same test names every time: pytest-xdist's workers each collect the suite and refuse
to run when their lists differ, so a test name that depends on the clock (a gzip header's mtime), on hash
order or on randomness fails CI by chance. This run's own collection against a second one, made later in a
subprocess with another hash seed (one collection costs 10-30 s on the build machine, so it is made once)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _collect(seed: str) -> list[str]:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                          "tests"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_two_collections_name_the_same_tests(request: pytest.FixtureRequest) -> None:
    opts = request.config.option
    whole = all(Path(a).resolve() == ROOT / "tests" for a in request.config.args)
    if not whole or opts.keyword or opts.markexpr:
        pytest.skip("this run collected a part of the suite: nothing to compare the whole with")
    mine = sorted(item.nodeid for item in request.session.items)
    other = sorted(_collect("1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"))
    assert len(other) > 1000
    assert mine == other, sorted(set(mine) ^ set(other))[:10]
