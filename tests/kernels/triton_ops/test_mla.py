"""Triton MLA decode and latent-cache write (interpreter on CPU) against the torch reference; the routed
experts of fused MoE with routing given from outside.

Tolerances: fp32 rtol/atol 1e-4, fp16 1e-2.
"""

from __future__ import annotations

import pytest
import torch

from lbd.kernels import triton_ops as tri
from lbd.kernels.reference import mla as ref
from lbd.kernels.reference import moe as ref_moe
from support.paged_cases import absorbed_query, make_mla_case

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=1e-2, atol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(dtype: torch.dtype, num_splits: int) -> None:
    # 5 heads: a partial head block; lora 24 and rope 8: both padded inside the kernel
    case = make_mla_case([(1, 13), (1, 1), (1, 37)], heads=5, lora=24, rope=8, nope=8, v_dim=8,
                         block_size=8, dtype=dtype, seed=num_splits)
    q = absorbed_query(case, slice(0, 3))
    got = tri.mla_decode(q, case.cache, case.meta, case.scale, case.lora, num_splits=num_splits)
    want = ref.mla_decode(q, case.cache, case.meta, case.scale, case.lora)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_decode_more_splits_than_tiles_and_block_size_one() -> None:
    case = make_mla_case([(1, 5), (1, 20)], heads=2, lora=16, rope=16, nope=8, v_dim=8, block_size=1, seed=7)
    q = absorbed_query(case, slice(0, 2))
    got = tri.mla_decode(q, case.cache, case.meta, case.scale, case.lora, num_splits=4)
    torch.testing.assert_close(got, ref.mla_decode(q, case.cache, case.meta, case.scale, case.lora),
                               **TOL[torch.float32])


def test_write_mla_cache_matches_reference() -> None:
    g = torch.Generator().manual_seed(0)
    kv_c = torch.randn(5, 2 * 12, generator=g)[:, :12]  # a strided view, as the model passes it
    k_pe = torch.randn(5, 8, generator=g)
    slots = torch.tensor([3, -1, 17, 0, 9])
    got, want = torch.full((4, 5, 20), 7.0), torch.full((4, 5, 20), 7.0)
    tri.write_mla_cache(kv_c, k_pe, got, slots)
    ref.write_mla_cache(kv_c, k_pe, want, slots)
    assert torch.equal(got, want)


def test_fused_experts_with_given_routing() -> None:
    g = torch.Generator().manual_seed(4)
    t, d, inter = 9, 32, 24
    hidden = torch.randn(t, d, generator=g)
    w13 = torch.randn(3, 2 * inter, d, generator=g) / d**0.5
    w2 = torch.randn(3, d, inter, generator=g) / inter**0.5
    ids = torch.randint(0, 6, (t, 2), generator=g, dtype=torch.int32)
    weights = torch.rand(t, 2, generator=g) * 2.5  # e.g. routed_scaling_factor applied
    emap = torch.tensor([-1, 0, -1, 1, 2, -1], dtype=torch.int32)
    got = tri.fused_experts(hidden, w13, w2, weights, ids, emap)
    torch.testing.assert_close(got, ref_moe.fused_experts(hidden, w13, w2, weights, ids, emap),
                               **TOL[torch.float32])
