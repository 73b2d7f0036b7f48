"""The torch paged-attention and KV-write references against plain dense attention."""

from __future__ import annotations

import pytest
import torch

from lbd.kernels.reference.attention import paged_attention, write_kv_cache
from support.paged_cases import dense_attention, make_case

FP32_TOL = dict(rtol=1e-4, atol=1e-4)
MIXED = [(1, 17), (1, 1), (1, 32), (5, 5), (7, 23), (16, 16)]  # decodes, fresh prefill, cached-prefix prefill


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (4, 1)])
def test_mixed_batch_matches_dense(head_dim: int, heads: int, kv_heads: int) -> None:
    case = make_case(MIXED, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=8, pad_tokens=2)
    out = paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale)
    total = sum(case.meta.query_lens_cpu)
    torch.testing.assert_close(out[:total].double(), dense_attention(case), **FP32_TOL)
    assert torch.all(out[total:] == 0)


@pytest.mark.parametrize("lens", [[(1, 9), (1, 40)], [(12, 12)], [(3, 50), (1, 1)][::-1]])
def test_decode_only_prefill_only(lens: list[tuple[int, int]]) -> None:
    case = make_case(lens, heads=8, kv_heads=2, head_dim=64, block_size=16)
    out = paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale)
    torch.testing.assert_close(out.double(), dense_attention(case), **FP32_TOL)


def test_without_host_lists_matches() -> None:
    case = make_case(MIXED, heads=4, kv_heads=2, head_dim=64, block_size=4)
    want = dense_attention(case)
    case.meta.query_lens_cpu = None
    case.meta.seq_lens_cpu = None
    out = paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale)
    torch.testing.assert_close(out.double(), want, **FP32_TOL)


def test_fp16_matches_dense() -> None:
    case = make_case(MIXED, heads=6, kv_heads=3, head_dim=64, block_size=8, dtype=torch.float16)
    out = paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale)
    torch.testing.assert_close(out.double(), dense_attention(case), rtol=1e-2, atol=1e-2)


def test_fp8_cache_reads_back_with_scale() -> None:
    # The oracle sees the keys as the fp8 cache can hold them (quantised then scaled back).
    case = make_case(MIXED, heads=4, kv_heads=2, head_dim=64, block_size=8, cache_dtype=torch.float8_e4m3fn,
                     k_scale=0.5, v_scale=0.25)
    for ks in (case.keys, case.values):
        sc = 0.5 if ks is case.keys else 0.25
        ks[:] = [(k / sc).to(torch.float8_e4m3fn).float() * sc for k in ks]
    out = paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale, 0.5, 0.25)
    torch.testing.assert_close(out.double(), dense_attention(case), **FP32_TOL)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.float8_e4m3fn])
def test_write_kv_cache_scatters_and_skips_padding(cache_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    nb, bs, hkv, d = 6, 4, 2, 80
    key, value = torch.randn(5, hkv, d, generator=g), torch.randn(5, hkv, d, generator=g)
    slots = torch.tensor([13, -1, 0, 22, -1])
    kc = (torch.randn(nb, bs, hkv, d, generator=g) * 5).to(cache_dtype)
    vc = (torch.randn(nb, bs, hkv, d, generator=g) * 5).to(cache_dtype)
    before_k, before_v = kc.clone(), vc.clone()
    write_kv_cache(key, value, kc, vc, slots, k_scale=2.0, v_scale=0.5)
    scale_k, scale_v = (2.0, 0.5) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    flat_k, flat_v = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        assert torch.equal(flat_k[s], (key[t] / scale_k).to(cache_dtype))
        assert torch.equal(flat_v[s], (value[t] / scale_v).to(cache_dtype))
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[[13, 0, 22]] = False
    assert torch.equal(flat_k[untouched].float(), before_k.view(-1, hkv, d)[untouched].float())
    assert torch.equal(flat_v[untouched].float(), before_v.view(-1, hkv, d)[untouched].float())


def test_many_decodes_of_mixed_lengths_match_dense() -> None:
    """Enough decodes of very different lengths that the reference groups them by length."""
    lens = [(1, n) for n in (3, 70, 9, 41, 120, 5, 66, 33, 97, 2, 18, 55, 128, 7, 81, 24, 60)] + [(6, 30)]
    case = make_case(lens, heads=6, kv_heads=2, head_dim=64, block_size=8)
    out = paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale)
    torch.testing.assert_close(out.double(), dense_attention(case), **FP32_TOL)
