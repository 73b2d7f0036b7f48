from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from lbd.engine.procutil import set_pdeathsig

# Triton's interpreter must be chosen before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# `lbd route` defaults to a worker per CPU; the suite's many routers run one each (tests that mean more
# say --workers), so two xdist workers on two cores are not contended by them
os.environ.setdefault("LBD_ROUTE_WORKERS", "1")
# The test-support package (tests/support); lbd itself comes from the installed package (src layout).
sys.path.insert(0, str(Path(__file__).parent))

from support import (  # noqa: E402
    RouterProc,
    kill_leftovers,
    make_tiny_deepseek_v2,
    make_tiny_llama,
    make_tiny_mixtral,
    make_tiny_qwen3,
    make_tiny_qwen3_moe,
)


def _interrupted(*_: object) -> None:
    raise KeyboardInterrupt


def _worker_interrupted(*_: object) -> None:
    kill_leftovers()  # at once: the run that started this worker gives it seconds, not a graceful teardown
    raise KeyboardInterrupt


def _run_interrupted(*_: object) -> None:
    for worker in psutil.Process().children():  # a parallel run's direct children are its workers
        with contextlib.suppress(psutil.Error):
            worker.terminate()
    raise KeyboardInterrupt


def pytest_configure(config: pytest.Config) -> None:
    """A SIGTERM (a CI timeout, a `kill`) ends the run as Ctrl-C does: the fixtures tear down, so no server a
    module-scoped fixture started outlives the suite. In a parallel run (pytest-xdist) the run passes it to
    its workers, each of which kills what its tests started, and a worker gets it too when the run that
    started it dies, however it dies."""
    if hasattr(config, "workerinput"):
        signal.signal(signal.SIGTERM, _worker_interrupted)
        set_pdeathsig(signal.SIGTERM)
    elif config.getoption("numprocesses", None):
        signal.signal(signal.SIGTERM, _run_interrupted)
    else:
        signal.signal(signal.SIGTERM, _interrupted)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with a ``long`` test first, then files with ``slow`` tests, then the rest, each group in
    collection order. scripts/test.sh runs files on two workers in this order, so the longest start at once
    and the run ends on short files, with neither worker left alone with a long one at the end."""
    level: dict[Path, int] = {}
    for item in items:
        mine = 0 if item.get_closest_marker("long") else 1 if item.get_closest_marker("slow") else 2
        level[item.path] = min(level.get(item.path, 2), mine)
    items.sort(key=lambda item: level[item.path])


def pytest_unconfigure(config: pytest.Config) -> None:
    """Whatever an interrupted test started and did not stop goes with the run."""
    kill_leftovers()


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


# Tiny MoE / MLA checkpoints (2 layers, hidden 64, 4-8 experts; ~0.1 s each to build)
@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_mixtral(tmp_path_factory.mktemp("tiny-mixtral"))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"))


@pytest.fixture(scope="session")
def tiny_deepseek_v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """V2-Lite's shape: no q_lora_rank, greedy routing; yarn rope with mscale."""
    return make_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny-deepseek-v2"), yarn=True)


@pytest.fixture(scope="session")
def tiny_deepseek_v2_grouped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """V2's shape: q_lora_rank, group-limited greedy routing."""
    return make_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny-deepseek-v2-grouped"), q_lora_rank=32,
                                 topk_method="group_limited_greedy")


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
