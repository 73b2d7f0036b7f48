"""lbd.kernels.ops picks the implementation from LBD_KERNELS, read once at import, in fresh interpreters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys, torch
from lbd.kernels import ops
x = torch.randn(3, 32)
out = ops.rms_norm(x, torch.ones(32), 1e-6)
assert out.shape == (3, 32) and torch.isfinite(out).all()
print(ops.MODE, ops.backend_for("cpu"), ops.backend_for("cuda"), "lbd.kernels.triton_ops" in sys.modules,
      "triton" in sys.modules)
"""


def _probe(mode: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LBD_KERNELS"}
    env["TRITON_INTERPRET"] = "1"
    if mode is not None:
        env["LBD_KERNELS"] = mode
    return subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("mode,want", [
    (None, "auto torch triton False False"),  # CPU tensors under auto never import triton
    ("torch", "torch torch torch False False"),
    ("TRITON", "triton triton triton True True"),
])
def test_mode_selects_backend(mode: str | None, want: str) -> None:
    run = _probe(mode)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == want


def test_bad_mode_fails_at_import() -> None:
    run = _probe("cuda")
    assert run.returncode != 0
    assert "LBD_KERNELS must be one of" in run.stderr
