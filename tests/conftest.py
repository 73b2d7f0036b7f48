from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Triton's interpreter must be chosen before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))
# The repo root too: otherwise tests/policies, tests/engine... shadow the real packages as namespace packages
# (the editable install's finder runs after the path finder).
sys.path.insert(1, str(Path(__file__).parent.parent))

from support import make_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random-weight Llama with a real (small BPE) tokenizer and ChatML template."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
