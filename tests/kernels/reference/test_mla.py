"""The torch MLA reference (absorbed decode, expanded prefill, latent-cache write) and DeepSeek's grouped
top-k routing against plain fp64 definitions."""

from __future__ import annotations

import pytest
import torch

from lbd.kernels.reference import mla
from lbd.kernels.reference.moe import fused_experts, grouped_topk
from support.paged_cases import absorbed_query, dense_grouped_topk, dense_mla, make_mla_case

FP32_TOL = dict(rtol=1e-4, atol=1e-5)
# decodes (one inside a block, one over several), a fresh prompt, two chunks after a cached prefix
MIXED = [(1, 13), (1, 40), (7, 7), (5, 21), (1, 30)]


def _case(dtype: torch.dtype = torch.float32, seed: int = 0):
    return make_mla_case(MIXED, heads=4, lora=32, rope=8, nope=16, v_dim=12, block_size=8, dtype=dtype,
                         seed=seed)


def test_absorbed_decode_matches_expanded_attention() -> None:
    case = _case()
    nd = case.meta.num_decodes
    o_lat = mla.mla_decode(absorbed_query(case, slice(0, nd)), case.cache, case.meta, case.scale, case.lora)
    _, w_uv = case.w_uk_uv()
    got = torch.einsum("bhl,hdl->bhd", o_lat, w_uv)
    torch.testing.assert_close(got.double(), dense_mla(case)[:nd], **FP32_TOL)


def test_prefill_matches_expanded_attention() -> None:
    case = _case(seed=1)
    nd = case.meta.num_decodes
    q = torch.cat([case.q_nope, case.q_pe], dim=-1)[nd:]
    got = mla.mla_prefill(q, case.cache, case.meta, case.kv_b, case.lora, case.v_dim, case.scale)
    torch.testing.assert_close(got.double(), dense_mla(case)[nd:], **FP32_TOL)


def test_decode_and_prefill_agree_on_the_last_token() -> None:
    # The same sequence's last query through both forms: absorbed decode and expanded prefill (n = 1).
    case = make_mla_case([(1, 29)], heads=3, lora=16, rope=8, nope=8, v_dim=8, block_size=4, seed=2)
    o_lat = mla.mla_decode(absorbed_query(case, slice(0, 1)), case.cache, case.meta, case.scale, case.lora)
    _, w_uv = case.w_uk_uv()
    decoded = torch.einsum("bhl,hdl->bhd", o_lat, w_uv)
    case.meta.num_decodes = case.meta.num_decode_tokens = 0  # now the same row as a one-token prefill chunk
    q = torch.cat([case.q_nope, case.q_pe], dim=-1)
    prefilled = mla.mla_prefill(q, case.cache, case.meta, case.kv_b, case.lora, case.v_dim, case.scale)
    torch.testing.assert_close(decoded, prefilled, **FP32_TOL)


def test_write_mla_cache_skips_padding() -> None:
    cache = torch.zeros(3, 4, 10)
    kv_c, k_pe = torch.randn(3, 6), torch.randn(3, 4)
    mla.write_mla_cache(kv_c, k_pe, cache, torch.tensor([5, -1, 0]))
    flat = cache.view(-1, 10)
    torch.testing.assert_close(flat[5], torch.cat([kv_c[0], k_pe[0]]))
    torch.testing.assert_close(flat[0], torch.cat([kv_c[2], k_pe[2]]))
    assert flat.count_nonzero(dim=1).tolist().count(0) == 10  # nothing else written


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("experts,groups,topk_groups,top_k", [(8, 4, 2, 3), (16, 8, 3, 6), (6, 1, 1, 2)])
def test_grouped_topk(experts: int, groups: int, topk_groups: int, top_k: int, renormalize: bool) -> None:
    logits = torch.randn(11, experts, generator=torch.Generator().manual_seed(experts)) * 2
    weights, ids = grouped_topk(logits, top_k, groups, topk_groups, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    for row, want in enumerate(dense_grouped_topk(logits, top_k, groups, topk_groups, renormalize)):
        got = dict(zip(ids[row].tolist(), weights[row].tolist(), strict=True))
        assert set(got) == set(want)
        for e, w in want.items():
            assert got[e] == pytest.approx(w, rel=1e-5)


def test_fused_experts_takes_any_routing() -> None:
    # Weights from elsewhere (scaled, not summing to 1) and an expert owned by another rank.
    g = torch.Generator().manual_seed(3)
    t, d, inter, e = 7, 16, 12, 4
    hidden = torch.randn(t, d, generator=g)
    w13 = torch.randn(e, 2 * inter, d, generator=g) / d**0.5
    w2 = torch.randn(e, d, inter, generator=g) / inter**0.5
    ids = torch.randint(0, e, (t, 2), generator=g, dtype=torch.int32)
    weights = torch.rand(t, 2, generator=g) * 3
    emap = torch.tensor([0, 1, -1, 2], dtype=torch.int32)
    got = fused_experts(hidden, w13[[0, 1, 3]], w2[[0, 1, 3]], weights, ids, emap)
    want = torch.zeros(t, d, dtype=torch.float64)
    for i in range(t):
        for k in range(2):
            ex = int(ids[i, k])
            if ex == 2:
                continue
            gu = w13[ex].double() @ hidden[i].double()
            want[i] += weights[i, k].double() * (w2[ex].double() @ (torch.nn.functional.silu(gu[:inter])
                                                                      * gu[inter:]))
    torch.testing.assert_close(got.double(), want, **FP32_TOL)
