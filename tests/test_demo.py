"""The README's run command: a supervised node of two default-model ranks behind the router answers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support import free_port, free_port_run

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_answers_through_the_router() -> None:
    rank_port = free_port_run(2)
    ports = ["--rank-port", str(rank_port), "--supervisor-port", str(free_port()),
             "--router-port", str(free_port())]
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--once", *ports],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    answer = next(line for line in out.stdout.splitlines() if line.startswith("A: "))
    assert "Paris" in answer
