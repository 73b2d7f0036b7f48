"""Rotary position embedding applied to packed q/k (neox or GPT-J layout, optionally partial)."""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> None:
    """Rotate the first rotary_dim dims of every head of x[T, H, d] in place; cos/sin are [T, 1, rd/2]."""
    rd = cos.shape[-1] * 2
    rot = x[..., :rd]
    if is_neox:
        x1, x2 = rot[..., : rd // 2], rot[..., rd // 2 :]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    x1.copy_(o1)
    x2.copy_(o2)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
                     head_dim: int, is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    cs = cos_sin.index_select(0, positions.reshape(-1)).to(q.dtype)
    cos, sin = cs.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    n = positions.numel()
    q3 = q.view(n, -1, head_dim)
    k3 = k.view(n, -1, head_dim)
    _rotate(q3, cos, sin, is_neox)
    _rotate(k3, cos, sin, is_neox)
    return q, k
