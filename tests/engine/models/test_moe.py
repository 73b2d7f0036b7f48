"""Greedy tokens of our engine vs transformers on tiny Mixtral, Qwen3, Qwen3-MoE and DeepSeek-V2 checkpoints
(both routing methods, with and without q_lora_rank), with test_parity's near-tie rule. Each architecture
runs one of the two generation tests (concurrent mixed lengths; or chunked prefill + prefix-cache hits +
preemption with four concurrent requests), which keeps the file's cost down; test_moe_server.py compares
three of them with transformers again over HTTP. Then MLA's absorbed decode against its expanded prefill,
MLA's KV capacity and start-up line, and the Triton kernels' path against the torch one."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from lbd.engine.core.engine_core import EngineCore
from support.parity import assert_all_close, engine_args, greedy, hf_greedy, random_prompts, run_engine


def _vocab(path: Path) -> int:
    from lbd.engine.models.config import load_hf_config

    return load_hf_config(path).vocab_size


@pytest.mark.parametrize("kind", ["mixtral", "qwen3", "deepseek_v2_grouped"])
def test_concurrent_mixed_lengths(kind: str, request: pytest.FixtureRequest) -> None:
    checkpoint = request.getfixturevalue(f"tiny_{kind}")
    rng = random.Random(11)
    prompts = random_prompts(6, (1, 150), _vocab(checkpoint), seed=11)
    max_tokens = [rng.randint(4, 16) for _ in prompts]
    core = EngineCore.from_args(engine_args(checkpoint), str(checkpoint))
    ours = run_engine(core, prompts, [greedy(n) for n in max_tokens])
    assert_all_close(ours, hf_greedy(checkpoint, prompts, max_tokens))


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v2"])
def test_chunked_prefill_prefix_hits_and_preemption(kind: str, request: pytest.FixtureRequest) -> None:
    checkpoint = request.getfixturevalue(f"tiny_{kind}")
    probe = EngineCore.from_args(engine_args(checkpoint), str(checkpoint))
    per_block = probe.runner.kv_spec.bytes_per_block
    args = engine_args(checkpoint, kv_cache_memory_bytes=10 * per_block, max_model_len=128,
                       max_num_batched_tokens=16)
    core = EngineCore.from_args(args, str(checkpoint))
    assert core.runner.num_blocks == 10 and core.config.max_num_batched_tokens == 16
    vocab = _vocab(checkpoint)
    shared = random_prompts(1, (40, 40), vocab, seed=12)[0]
    prompts = [shared + tail for tail in random_prompts(5, (3, 20), vocab, seed=13)]
    first = run_engine(core, prompts[:1], [greedy(20)], prefix="a")
    hits = core.scheduler.kv.prefix_hits
    rest = run_engine(core, prompts[1:], [greedy(20)] * 4, prefix="b")
    assert core.scheduler.kv.prefix_hits - hits >= 4 * 32  # two full blocks of the shared prefix each
    assert core.scheduler.counters.num_preemptions > 0
    assert core.scheduler.kv.num_free_blocks == 10
    assert_all_close(first + rest, hf_greedy(checkpoint, prompts, [20] * 5))


def test_mla_decode_matches_prefill(tiny_deepseek_v2: Path) -> None:
    """Tokens 2.. of a generation come from the absorbed decode; the same positions through the expanded
    prefill (the whole sequence so far as a fresh prompt, no prefix cache) give the same tokens."""
    path = tiny_deepseek_v2
    prompts = random_prompts(3, (5, 60), _vocab(path), seed=14)
    decoded = run_engine(EngineCore.from_args(engine_args(path), str(path)), prompts, [greedy(12)] * 3)
    fresh = EngineCore.from_args(engine_args(path, enable_prefix_caching=False), str(path))
    seqs = [p + run.tokens[:i] for p, run in zip(prompts, decoded, strict=True) for i in range(1, 12)]
    prefilled = run_engine(fresh, seqs, [greedy(1)] * len(seqs))
    for j, run in enumerate(decoded):
        for i in range(1, 12):
            got = prefilled[j * 11 + i - 1]
            assert got.tokens == [run.tokens[i]], (j, i)
            assert abs(got.chosen[0] - run.chosen[i]) < 1e-4


def test_mla_cache_holds_latents_and_sizes_the_capacity(tiny_deepseek_v2: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="lbd.engine.core.runner")
    args = engine_args(tiny_deepseek_v2, kv_cache_memory_bytes=1 << 20)
    core = EngineCore.from_args(args, str(tiny_deepseek_v2))
    runner = core.runner
    # 2 layers x (kv_lora_rank 32 + rope 8) fp32 values per token, 16 tokens per block
    assert runner.kv_spec.bytes_per_block == 2 * 40 * 4 * 16
    assert runner.num_blocks == (1 << 20) // (2 * 40 * 4 * 16)
    assert [tuple(c.shape) for c in runner.kv_caches] == [(runner.num_blocks, 16, 40)] * 2
    # MHA would keep 4 heads x (K 24 + V 16) per layer
    assert "MLA KV cache: 320 bytes per token (2 layers x 40 latent values), plain MHA of this model would " \
           "take 1280 (4.0x more)" in caplog.text


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v2_grouped"])  # top-k softmax + q/k norms; MLA
def test_triton_path_gives_the_torch_path_tokens(kind: str, request: pytest.FixtureRequest,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every op of the model through its Triton kernel (the interpreter, fp32), as on CUDA minus graphs,
    against the torch references: a prefix-cache hit, chunked prefill, decodes batched with a chunk."""
    from lbd.kernels import ops

    path = request.getfixturevalue(f"tiny_{kind}")
    a, b, c = random_prompts(3, (20, 20), _vocab(path), seed=15)
    args = engine_args(path, block_size=8, max_num_batched_tokens=16)

    def generate() -> list:
        core = EngineCore.from_args(args, str(path))
        first = run_engine(core, [a], [greedy(2)], prefix="a")
        rest = run_engine(core, [a[:16] + b[:4], c], [greedy(3)] * 2, prefix="b")
        assert core.scheduler.kv.prefix_hits >= 16
        return first + rest

    want = generate()
    monkeypatch.setattr(ops, "MODE", "triton")
    got = generate()
    assert ops._triton_mod is not None
    assert [r.tokens for r in got] == [r.tokens for r in want]
    for g, w in zip(got, want, strict=True):
        assert g.chosen == pytest.approx(w.chosen, abs=1e-4)
