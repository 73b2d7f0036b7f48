"""Rotary embedding applied in place to packed q/k: one program per token covers every head of q and k."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, stride_t, tok, n_heads, cos, sin, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                  HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr, IS_NEOX: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < n_heads) & (i[None, :] < HALF)
    base = x_ptr + tok * stride_t + heads[:, None] * HEAD_DIM
    if IS_NEOX:
        p1 = base + i[None, :]
        p2 = p1 + HALF
    else:
        p1 = base + 2 * i[None, :]
        p2 = p1 + 1
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cs_ptr, stride_q, stride_k, stride_cs, n_q_heads, n_k_heads,
                   HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, QH_PAD: tl.constexpr,
                   KH_PAD: tl.constexpr, IS_NEOX: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    cos = tl.load(cs_ptr + pos * stride_cs + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, stride_q, tok, n_q_heads, cos, sin, HEAD_DIM, HALF, QH_PAD, HALF_PAD, IS_NEOX)
    _rotate_heads(k_ptr, stride_k, tok, n_k_heads, cos, sin, HEAD_DIM, HALF, KH_PAD, HALF_PAD, IS_NEOX)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
                     head_dim: int, is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    n = positions.numel()
    if n == 0:
        return q, k
    q2, k2 = q.view(n, -1), k.view(n, -1)
    if q2.stride(1) != 1 or k2.stride(1) != 1 or cos_sin.stride(1) != 1:
        raise ValueError("rotary_embedding needs q, k and cos_sin dense along the last dimension")
    half = cos_sin.shape[1] // 2
    n_q, n_k = q2.shape[1] // head_dim, k2.shape[1] // head_dim
    _rotary_kernel[(n,)](positions, q2, k2, cos_sin, q2.stride(0), k2.stride(0), cos_sin.stride(0), n_q, n_k,
                         HEAD_DIM=head_dim, HALF=half, HALF_PAD=triton.next_power_of_2(half),
                         QH_PAD=triton.next_power_of_2(n_q), KH_PAD=triton.next_power_of_2(n_k),
                         IS_NEOX=is_neox)
    return q, k
