"""Torch references for MoE, routing, RMSNorm and SiLU-and-mul against the simplest definitions."""

from __future__ import annotations

import pytest
import torch

from lbd.kernels.reference.elementwise import rms_norm, silu_and_mul
from lbd.kernels.reference.moe import fused_moe, topk_softmax
from support.paged_cases import dense_moe

FP32_TOL = dict(rtol=1e-4, atol=1e-5)


def _moe_inputs(t: int, d: int, inter: int, e_local: int, e_global: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, d, generator=g)
    w13 = torch.randn(e_local, 2 * inter, d, generator=g) / d**0.5
    w2 = torch.randn(e_local, d, inter, generator=g) / inter**0.5
    logits = torch.randn(t, e_global, generator=g) * 2
    return hidden, w13, w2, logits


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_fused_moe_matches_dense(renormalize: bool, top_k: int) -> None:
    hidden, w13, w2, logits = _moe_inputs(t=13, d=32, inter=48, e_local=6, e_global=6)
    out = fused_moe(hidden, w13, w2, logits, top_k, renormalize)
    want = dense_moe(hidden, w13, w2, logits, top_k, renormalize)
    torch.testing.assert_close(out.double(), want, **FP32_TOL)


@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_with_expert_map(renormalize: bool) -> None:
    # This rank owns global experts 5, 1, 6 (as local 0, 1, 2); the others contribute nothing here.
    hidden, w13, w2, logits = _moe_inputs(t=11, d=32, inter=16, e_local=3, e_global=8, seed=1)
    emap = torch.full((8,), -1, dtype=torch.int32)
    emap[torch.tensor([5, 1, 6])] = torch.tensor([0, 1, 2], dtype=torch.int32)
    out = fused_moe(hidden, w13, w2, logits, 2, renormalize, emap)
    want = dense_moe(hidden, w13, w2, logits, 2, renormalize, emap)
    torch.testing.assert_close(out.double(), want, **FP32_TOL)


def test_expert_map_shards_sum_to_the_whole() -> None:
    hidden, w13, w2, logits = _moe_inputs(t=9, d=16, inter=24, e_local=8, e_global=8, seed=2)
    whole = fused_moe(hidden, w13, w2, logits, 2, True)
    parts = torch.zeros_like(whole)
    for owned in (torch.tensor([0, 2, 4, 6]), torch.tensor([1, 3, 5, 7])):
        emap = torch.full((8,), -1, dtype=torch.int32)
        emap[owned] = torch.arange(4, dtype=torch.int32)
        parts += fused_moe(hidden, w13[owned], w2[owned], logits, 2, True, emap)
    torch.testing.assert_close(parts, whole, **FP32_TOL)


def test_topk_softmax() -> None:
    logits = torch.randn(10, 7, generator=torch.Generator().manual_seed(5))
    w, ids = topk_softmax(logits, 3, renormalize=False)
    probs = logits.softmax(-1)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    torch.testing.assert_close(w, probs.gather(1, ids.long()))
    assert torch.all(w[:, :-1] >= w[:, 1:])
    assert torch.all(w[:, -1:] >= probs.masked_fill(torch.zeros_like(probs, dtype=torch.bool).scatter(
        1, ids.long(), True), -1).max(-1, keepdim=True).values)
    wn, ids_n = topk_softmax(logits, 3, renormalize=True)
    assert torch.equal(ids_n, ids)
    torch.testing.assert_close(wn.sum(-1), torch.ones(10))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-2)])
def test_rms_norm_and_residual(dtype: torch.dtype, tol: float) -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 96, generator=g).to(dtype)
    r = torch.randn(5, 96, generator=g).to(dtype)
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)

    def simplest(v: torch.Tensor) -> torch.Tensor:
        v = v.double()
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + 1e-6) * w.double()

    torch.testing.assert_close(rms_norm(x, w, 1e-6).double(), simplest(x), rtol=tol, atol=tol)
    out, new_res = rms_norm(x, w, 1e-6, residual=r)
    torch.testing.assert_close(new_res, x + r)
    torch.testing.assert_close(out.double(), simplest(x + r), rtol=tol, atol=tol)


def test_silu_and_mul() -> None:
    x = torch.randn(4, 2 * 40, generator=torch.Generator().manual_seed(7))
    a, b = x[:, :40].double(), x[:, 40:].double()
    torch.testing.assert_close(silu_and_mul(x).double(), a / (1 + torch.exp(-a)) * b, rtol=1e-6, atol=1e-6)
