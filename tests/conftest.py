from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Triton's interpreter must be chosen before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))
# The repo root too: otherwise tests/policies, tests/engine... shadow the real packages as namespace packages
# (the editable install's finder runs after the path finder).
sys.path.insert(1, str(Path(__file__).parent.parent))

from support import RouterProc, make_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def slower_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer, 512-wide random Llama (60 MB, 1024 positions) for tests that need a request to still be
    running a moment later: the 2-layer one now writes 400 tokens in well under a second."""
    return make_tiny_llama(tmp_path_factory.mktemp("slower-llama"), layers=4, hidden=512, heads=8, kv_heads=2,
                           intermediate=2048, max_pos=1024)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random-weight Llama with a real (small BPE) tokenizer and ChatML template."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def start_router(tmp_path: Path) -> Iterator:
    procs: list[RouterProc] = []

    def start(*args: str) -> RouterProc:
        proc = RouterProc(list(args), tmp_path / f"router-{len(procs)}.log")
        procs.append(proc)
        return proc

    try:
        yield start
    finally:
        for p in procs:
            p.close()
