"""Triton top-k routing and fused MoE (interpreter on CPU) against the torch references.

Tolerances: fp32 rtol 1e-4 / atol 1e-5, fp16 1e-2.
"""

from __future__ import annotations

import pytest
import torch

from lbd.kernels import triton_ops as tri
from lbd.kernels.reference import moe as ref
from lbd.kernels.triton_ops.moe import align_by_expert

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}


def _inputs(t: int, d: int, inter: int, e_local: int, e_global: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, d, generator=g).to(dtype)
    w13 = (torch.randn(e_local, 2 * inter, d, generator=g) / d**0.5).to(dtype)
    w2 = (torch.randn(e_local, d, inter, generator=g) / inter**0.5).to(dtype)
    logits = (torch.randn(t, e_global, generator=g) * 2).to(dtype)
    return hidden, w13, w2, logits


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("n_experts,top_k", [(8, 2), (6, 1), (60, 4)])
def test_topk_softmax(renormalize: bool, n_experts: int, top_k: int) -> None:
    logits = torch.randn(9, n_experts, generator=torch.Generator().manual_seed(n_experts))
    w, ids = tri.topk_softmax(logits, top_k, renormalize)
    rw, rids = ref.topk_softmax(logits, top_k, renormalize)
    assert ids.dtype == rids.dtype == torch.int32
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe(dtype: torch.dtype, renormalize: bool) -> None:
    hidden, w13, w2, logits = _inputs(t=10, d=48, inter=40, e_local=5, e_global=5, dtype=dtype, seed=1)
    got = tri.fused_moe(hidden, w13, w2, logits, 2, renormalize)
    want = ref.fused_moe(hidden, w13, w2, logits, 2, renormalize)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_expert_map(renormalize: bool) -> None:
    hidden, w13, w2, logits = _inputs(t=12, d=32, inter=24, e_local=3, e_global=8, dtype=torch.float32,
                                      seed=2)
    emap = torch.full((8,), -1, dtype=torch.int32)
    emap[torch.tensor([7, 2, 4])] = torch.tensor([0, 1, 2], dtype=torch.int32)
    got = tri.fused_moe(hidden, w13, w2, logits, 3, renormalize, emap)
    want = ref.fused_moe(hidden, w13, w2, logits, 3, renormalize, emap)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_fused_moe_gpu_block_m() -> None:
    hidden, w13, w2, logits = _inputs(t=20, d=32, inter=32, e_local=4, e_global=4, dtype=torch.float32,
                                      seed=3)
    got = tri.fused_moe(hidden, w13, w2, logits, 2, True, block_m=64)
    torch.testing.assert_close(got, ref.fused_moe(hidden, w13, w2, logits, 2, True), **TOL[torch.float32])


def test_align_by_expert_layout() -> None:
    local = torch.tensor([[2, 0], [-1, 2], [0, 1], [2, -1], [1, 2]], dtype=torch.int32)
    pairs, block_expert = align_by_expert(local, n_local=3, block_m=4)
    n_pairs = local.numel()
    flat = local.reshape(-1)
    seen = []
    for b, e in enumerate(block_expert.tolist()):
        rows = pairs[b * 4:(b + 1) * 4].tolist()
        real = [p for p in rows if p < n_pairs]
        if e < 0:
            assert not real
            continue
        assert all(int(flat[p]) == e for p in real)
        seen += real
    assert sorted(seen) == [i for i in range(n_pairs) if flat[i] >= 0]  # each owned pair exactly once
    assert block_expert.tolist()[:3] == [0, 1, 2]  # experts in order, one padded block each here
