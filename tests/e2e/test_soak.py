"""The 60-second version of benchmarks/soak.py: a supervised 2-rank node behind the router at 3 requests/s
(half streaming) with a chaos action every 10 s (kills, stops, a rolling restart, reset upstream links).
Nothing may be lost before its first byte, every failure has a reason, and the router's and the supervisor's
open files and threads stay flat."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(600)
def test_soak_60s_with_chaos_loses_nothing(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--duration-s", "60",
                          "--chaos-every-s", "10", "--rate", "3", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=540)
    assert (tmp_path / "soak.json").exists(), out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "soak.json").read_text())["summary"]
    assert out.returncode == 0, (summary["failed_by_reason"], out.stdout[-2000:])
    assert summary["lost_before_any_byte"] == 0 and summary["wrong"] == 0
    assert summary["completed"] + summary["broken_mid_stream"] == summary["sent"] >= 150
    assert sum(summary["failed_by_reason"].values()) == summary["broken_mid_stream"]  # each has its reason
    # and each follows a chaos action that cut live streams: nothing breaks on its own
    assert "no chaos action" not in summary["failed_by_chaos_action"], summary["failed_by_chaos_action"]
    assert len(summary["chaos"]) >= 3, summary["chaos"]
    assert all(not c["detail"].startswith("failed") for c in summary["chaos"]), summary["chaos"]
    for role in ("router", "supervisor"):
        r = summary["resources"][role]
        assert r["fds_last"] <= r["fds_first"] + 8 and r["threads_last"] <= r["threads_first"] + 2, (role, r)
    assert (tmp_path / "soak.png").stat().st_size > 10_000
