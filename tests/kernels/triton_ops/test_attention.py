"""Triton paged attention (interpreter on CPU) against the torch reference.

Tolerances: fp32 rtol/atol 1e-4, fp16 1e-2. The output is NaN-poisoned first, so every row (padding rows
included, which must come back zero) has to be written by the kernels.
"""

from __future__ import annotations

import pytest
import torch

from lbd.kernels import triton_ops as tri
from lbd.kernels.reference import attention as ref
from lbd.kernels.triton_ops import fp8
from support.paged_cases import PagedCase, make_case

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=1e-2, atol=1e-2)}
# decodes (one shorter than a block, one spanning blocks), then a fresh prompt and two cached-prefix prompts
MIXED = [(1, 13), (1, 1), (1, 37), (6, 6), (5, 21), (11, 30)]


def _run(case: PagedCase, k_scale: float = 1.0, v_scale: float = 1.0, **kw: int) -> tuple[torch.Tensor, ...]:
    poisoned = torch.full_like(case.query, float("nan"))
    got = tri.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale, k_scale,
                              v_scale, out=poisoned, **kw)
    want = ref.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale, k_scale,
                               v_scale)
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 4, 2), (80, 3, 1), (128, 2, 2)])
def test_mixed_batch(dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int) -> None:
    case = make_case(MIXED, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=8, dtype=dtype,
                     pad_tokens=3, seed=head_dim)
    got, want = _run(case, num_splits=3)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.all(got[-3:] == 0)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_split_kv_decode(num_splits: int) -> None:
    # More splits than a short sequence has key tiles: the empty splits must not disturb the merge.
    case = make_case([(1, 70), (1, 3), (1, 33)], heads=6, kv_heads=2, head_dim=96, block_size=16, seed=4)
    got, want = _run(case, num_splits=num_splits)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_gpu_tile_sizes_and_block_size_one() -> None:
    case = make_case([(1, 9), (40, 70)], heads=4, kv_heads=1, head_dim=64, block_size=1, seed=5)
    got, want = _run(case, num_splits=2, block_m=64, block_n=64)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("dtype,software_fp8", [(torch.float32, False), (torch.float16, False),
                                                (torch.float16, True)])
def test_fp8_cache(dtype: torch.dtype, software_fp8: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8, "force_software", software_fp8)  # sm_80-style: the cache read as raw bytes
    case = make_case(MIXED, heads=4, kv_heads=2, head_dim=64, block_size=8, dtype=dtype,
                     cache_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=0.25, seed=6)
    got, want = _run(case, 0.5, 0.25, num_splits=2)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_zero_length_decode_padding_gives_zeros() -> None:
    # A CUDA-graph batch padded with empty sequences (seq_len 0, slot -1) must stay finite.
    case = make_case([(1, 12), (1, 5)], heads=4, kv_heads=2, head_dim=64, block_size=4, seed=7)
    case.meta.seq_lens[1] = 0
    case.meta.seq_lens_cpu[1] = 0
    got, want = _run(case, num_splits=2)
    assert torch.all(got[1] == 0) and torch.all(want[1] == 0)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_prefill_only_without_host_lists() -> None:
    case = make_case([(9, 9), (4, 17)], heads=2, kv_heads=2, head_dim=64, block_size=4, seed=8)
    case.meta.query_lens_cpu = case.meta.seq_lens_cpu = None
    got, want = _run(case)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
