"""The 50-second version of benchmarks/soak.py: a supervised 3-rank P/D node behind the router at 3
requests/s (half streaming) with a chaos action every 3 s, each once every rank is ready again (kills, stops,
a rolling restart, reset upstream links). Nothing may be lost before its first byte, every failure has a
reason, and the router's and the supervisor's open files and threads stay flat.

It was 60 s at one action every 10 s. Its time is mostly rank restarts: the actions are a stopped core (a
restart), reset links, a killed rank (a restart), the rolling restart (three), a killed core, ... each once
the last one's restarts are done, and only while the load runs. At load 12 the 60 s run started its rolling
restart only after its load (at 65 s); 50 s at 3 s starts it at ~45 s, under load, in less time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DURATION_S, RATE = 50, 3


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(600)
def test_soak_with_chaos_loses_nothing(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--duration-s",
                          str(DURATION_S), "--chaos-every-s", "3", "--rate", str(RATE), "--out",
                          str(tmp_path)],
                         capture_output=True, text=True, timeout=540)
    assert (tmp_path / "soak.json").exists(), out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "soak.json").read_text())["summary"]
    assert out.returncode == 0, (summary["failed_by_reason"], out.stdout[-2000:])
    assert summary["lost_before_any_byte"] == 0 and summary["wrong"] == 0
    assert summary["completed"] + summary["broken_mid_stream"] == summary["sent"] >= 0.8 * DURATION_S * RATE
    assert sum(summary["failed_by_reason"].values()) == summary["broken_mid_stream"]  # each has its reason
    # and each follows a chaos action that cut live streams: nothing breaks on its own
    assert "no chaos action" not in summary["failed_by_chaos_action"], summary["failed_by_chaos_action"]
    assert len(summary["chaos"]) >= 3, summary["chaos"]
    assert all(not c["detail"].startswith("failed") for c in summary["chaos"]), summary["chaos"]
    for role in ("router", "supervisor"):
        r = summary["resources"][role]
        assert r["fds_last"] <= r["fds_first"] + 8 and r["threads_last"] <= r["threads_first"] + 2, (role, r)
    assert (tmp_path / "soak.png").stat().st_size > 10_000
