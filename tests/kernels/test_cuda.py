"""Compiled Triton kernels on CUDA (bf16/fp16/fp32) against the torch references run on the same device,
plus CUDA-graph capture of decode attention replayed at other lengths. Skipped without CUDA.

The test session runs with TRITON_INTERPRET=1 (for the CPU tests), under which kernels would be interpreted
even on CUDA tensors; so in that session one test re-runs this file in a child pytest with
TRITON_INTERPRET=0, where the checks below run compiled.

Tolerances: fp32 1e-4 (ieee dots), fp16 1e-2, bf16 3e-2 (8 mantissa bits, a few roundings deep).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.paged_cases import PagedCase, make_case

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
compiled_only = pytest.mark.skipif(INTERPRETED, reason="runs in the compiled child session")


@pytest.mark.skipif(not INTERPRETED, reason="this is the compiled session")
@pytest.mark.timeout(1800)
def test_compiled_kernels_in_child_session() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(argv, env=env, cwd=root, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=1e-2, atol=1e-2),
       torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _to_cuda(case: PagedCase) -> PagedCase:
    m = case.meta
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        setattr(m, name, getattr(m, name).cuda())
    case.query, case.key_cache = case.query.cuda(), case.key_cache.cuda()
    case.value_cache = case.value_cache.cuda()
    return case


@compiled_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_paged_attention(dtype: torch.dtype, head_dim: int) -> None:
    from lbd.kernels import triton_ops as tri
    from lbd.kernels.reference import attention as ref

    lens = [(1, n) for n in (1, 15, 16, 17, 300, 1000)] + [(1, 7)] * 20 + [(77, 77), (33, 400), (130, 131)]
    case = _to_cuda(make_case(lens, heads=8, kv_heads=2, head_dim=head_dim, block_size=16, dtype=dtype,
                              pad_tokens=5))
    got = tri.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale,
                              out=torch.full_like(case.query, float("nan")))
    want = ref.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale)
    torch.testing.assert_close(got, want, **TOL[dtype])


@compiled_only
def test_paged_attention_fp8_cache() -> None:
    from lbd.kernels import triton_ops as tri
    from lbd.kernels.reference import attention as ref

    case = _to_cuda(make_case([(1, 200), (1, 3), (40, 90)], heads=8, kv_heads=8, head_dim=128,
                              block_size=16, dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn,
                              k_scale=0.1, v_scale=0.2))
    got = tri.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale, 0.1, 0.2)
    want = ref.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale, 0.1, 0.2)
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])


@compiled_only
def test_decode_attention_under_cuda_graph() -> None:
    """Captured once with short sequences, replayed with longer ones: the split count baked into the graph
    must still cover every key."""
    from lbd.kernels import triton_ops as tri
    from lbd.kernels.reference import attention as ref

    case = _to_cuda(make_case([(1, 900)] * 4, heads=8, kv_heads=2, head_dim=64, block_size=16,
                              dtype=torch.bfloat16))
    m = case.meta
    short = torch.tensor([5, 17, 33, 2], dtype=torch.int32, device="cuda")
    seq_lens = m.seq_lens.clone()
    m.seq_lens.copy_(short)
    m.max_seq_len = 33
    out = torch.empty_like(case.query)
    tri.paged_attention(case.query, case.key_cache, case.value_cache, m, case.scale, out=out)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tri.paged_attention(case.query, case.key_cache, case.value_cache, m, case.scale, out=out)
    m.seq_lens.copy_(seq_lens)
    graph.replay()
    m.max_seq_len, m.seq_lens_cpu = 900, [900] * 4
    want = ref.paged_attention(case.query, case.key_cache, case.value_cache, m, case.scale)
    torch.testing.assert_close(out, want, **TOL[torch.bfloat16])


@compiled_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_rotary_kv_write(dtype: torch.dtype) -> None:
    from lbd.kernels import triton_ops as tri
    from lbd.kernels.reference import attention as ref_attn
    from lbd.kernels.reference import elementwise as ref
    from lbd.kernels.reference import rotary as ref_rot
    from lbd.kernels.rope_cache import build_rope_cache

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(37, 4096, device="cuda", generator=g).to(dtype)
    r = torch.randn(37, 4096, device="cuda", generator=g).to(dtype)
    w = (torch.rand(4096, device="cuda", generator=g) + 0.5).to(dtype)
    for a, b in zip(tri.rms_norm(x, w, 1e-5, r), ref.rms_norm(x, w, 1e-5, r), strict=True):
        torch.testing.assert_close(a, b, **TOL[dtype])
    gu = torch.randn(37, 2 * 1000, device="cuda", generator=g).to(dtype)
    torch.testing.assert_close(tri.silu_and_mul(gu), ref.silu_and_mul(gu), **TOL[dtype])
    cos_sin = build_rope_cache(128, 4096, 500000.0, {"rope_type": "llama3", "factor": 8.0,
                               "original_max_position_embeddings": 1024}, torch.float32, "cuda")
    pos = torch.randint(0, 4096, (37,), device="cuda", generator=g)
    for neox in (True, False):
        q = torch.randn(37, 32 * 128, device="cuda", generator=g).to(dtype)
        k = torch.randn(37, 8 * 128, device="cuda", generator=g).to(dtype)
        a = tri.rotary_embedding(pos, q.clone(), k.clone(), cos_sin, 128, neox)
        b = ref_rot.rotary_embedding(pos, q.clone(), k.clone(), cos_sin, 128, neox)
        for u, v in zip(a, b, strict=True):
            torch.testing.assert_close(u, v, **TOL[dtype])
    for cache_dtype in (dtype, torch.float8_e4m3fn):
        key = torch.randn(37, 8, 128, device="cuda", generator=g).to(dtype)
        slots = torch.randperm(64 * 16, device="cuda", generator=g)[:37]
        slots[::5] = -1
        caches = [torch.full((64, 16, 8, 128), float("nan"), device="cuda").to(cache_dtype) for _ in range(4)]
        tri.write_kv_cache(key, key, caches[0], caches[1], slots, 0.3, 0.3)
        ref_attn.write_kv_cache(key, key, caches[2], caches[3], slots, 0.3, 0.3)
        torch.testing.assert_close(caches[0].float(), caches[2].float(), rtol=0, atol=0, equal_nan=True)


@compiled_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_map", [False, True])
def test_fused_moe(dtype: torch.dtype, with_map: bool) -> None:
    from lbd.kernels import triton_ops as tri
    from lbd.kernels.reference import moe as ref

    g = torch.Generator(device="cuda").manual_seed(1)
    t, d, inter, e = 300, 1024, 768, 16
    hidden = torch.randn(t, d, device="cuda", generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, d, device="cuda", generator=g) / d**0.5).to(dtype)
    w2 = (torch.randn(e, d, inter, device="cuda", generator=g) / inter**0.5).to(dtype)
    logits = torch.randn(t, 2 * e if with_map else e, device="cuda", generator=g)
    emap = None
    if with_map:
        emap = torch.full((2 * e,), -1, dtype=torch.int32, device="cuda")
        emap[1::2] = torch.arange(e, dtype=torch.int32, device="cuda")
    got = tri.fused_moe(hidden, w13, w2, logits, 4, True, emap)
    want = ref.fused_moe(hidden, w13, w2, logits, 4, True, emap)
    torch.testing.assert_close(got, want, **TOL[dtype])
