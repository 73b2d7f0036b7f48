"""TP=2, PP=2 and TP=2 x PP=2 ranks (real worker processes, gloo) give TP=1's tokens.

One scenario per layout covers everything at once, so each layout starts its workers once: 16 concurrent
requests of mixed lengths under chunked prefill (32-token budget), prefix-cache hits (a warmed shared prefix)
and preemption (a small KV cache), greedy with the parity tests' near-tie rule, plus two seeded sampling
requests with repetition/frequency penalties (state the sampler worker keeps across steps), which must match
exactly. TP=2 x PP=2 runs a model with a single KV head (replicated on both TP ranks), tied embeddings (the
last stage loads its LM head from the embedding tensor) and an uneven --pp-layer-partition.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from lbd.engine.core.engine_core import EngineCore
from lbd.engine.core.step_profile import parse_line
from lbd.engine.executor.mp import WorkerFailure
from lbd.engine.rank_core import build_core
from lbd.wire.core_messages import EngineCoreRequest
from support import make_tiny_llama
from support.parity import (
    Run,
    assert_all_close,
    engine_args,
    greedy,
    parallel_core,
    parallel_scenario,
    run_engine,
)

LAYOUTS = {  # name: (model, tp, pp, --pp-layer-partition)
    "tp2": ("kv2", 2, 1, None),
    "pp2": ("kv2", 1, 2, None),
    "tp2pp2": ("mqa", 2, 2, "1,3"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("parallel-models")
    return {"kv2": make_tiny_llama(base / "kv2", layers=4, heads=4, kv_heads=2),
            "mqa": make_tiny_llama(base / "mqa", layers=4, heads=4, kv_heads=1, tie=True, seed=1)}


@pytest.fixture(scope="module")
def cores(models: dict[str, Path]) -> Iterator[Callable[[str], EngineCore]]:
    made: dict[str, EngineCore] = {}

    def get(name: str) -> EngineCore:
        if name not in made:
            model, tp, pp, partition = LAYOUTS[name]
            made[name] = parallel_core(models[model], tp, pp, partition)
        return made[name]

    yield get
    for core in made.values():
        core.close()


@pytest.fixture(scope="module")
def references(models: dict[str, Path]) -> dict[str, list[Run]]:
    out = {}
    for name, path in models.items():
        core = parallel_core(path)
        out[name] = parallel_scenario(core, core.runner.vocab_size)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_tokens_equal_tp1(layout: str, cores: Callable[[str], EngineCore],
                                   references: dict[str, list[Run]]) -> None:
    core = cores(layout)
    model, tp, pp, _ = LAYOUTS[layout]
    assert len(core.runner.worker_pids()) == tp * pp
    ours, ref = parallel_scenario(core, core.runner.vocab_size), references[model]
    assert_all_close(ours[:-2], ref[:-2])
    assert [r.tokens for r in ours[-2:]] == [r.tokens for r in ref[-2:]]  # seeded sampling with penalties


def test_profile_steps_count_the_executors_step_as_forward(cores: Callable[[str], EngineCore]) -> None:
    """--profile-steps on a TP rank: the workers run prepare .. sample, so the core sees their whole step
    (broadcast, compute, reply) as ``forward``, the largest phase, not as the scheduler's update."""
    core = cores("tp2")
    lines: list[str] = []
    prof = core.start_profiling(2)
    prof.sink = lines.append
    try:
        run_engine(core, [[5, 6, 7, 8], [9, 10]], [greedy(6), greedy(6)], prefix="prof")
    finally:
        core.stop_profiling()
    rows = [parse_line(x) for x in lines]
    assert rows and all(r["label"] == "core" for r in rows)
    for r in rows:
        phases = {k: float(r[k]) for k in ("schedule", "forward", "update") if k in r}
        assert max(phases, key=phases.__getitem__) == "forward", r


def test_a_dead_worker_fails_the_rank(cores: Callable[[str], EngineCore]) -> None:
    """SIGKILL of one worker: the watchdog kills the others and the next step raises (in the core process,
    ``run_core`` exits there; tests/supervisor/test_parallel.py covers the whole rank)."""
    core = cores("tp2")
    pids = core.runner.worker_pids()
    os.kill(pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while core.runner.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert core.runner.failure is not None and f"pid {pids[1]}" in core.runner.failure
    assert "SIGKILL" in core.runner.failure
    psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=10)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    core.add_request(EngineCoreRequest("late", [5, 6, 7], greedy(2), None, 0.0))
    with pytest.raises(WorkerFailure, match="SIGKILL"):
        core.step()


@pytest.mark.slow
def test_default_model_tp3_equals_tp1() -> None:
    """SmolLM2 (9 heads, 3 KV heads) split over three workers: one KV head and three query heads each."""
    from transformers import AutoTokenizer

    from lbd.engine.loader import resolve_model

    path = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(path)
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    texts = [chat, "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    params = [greedy(24)] * len(prompts)
    kw = {"kv_cache_memory_bytes": 256 << 20, "max_model_len": 2048}
    ref = run_engine(EngineCore.from_args(engine_args(path, **kw), str(path)), prompts, params)
    core = build_core(engine_args(path, tensor_parallel_size=3, **kw), str(path))
    try:
        ours = run_engine(core, prompts, params)
    finally:
        core.close()
    assert "Paris" in tok.decode(ours[0].tokens)
    assert_all_close(ours, ref)
