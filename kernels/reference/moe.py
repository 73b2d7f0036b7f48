"""Top-k softmax routing and the fused MoE block (grouped expert GEMMs) in torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def topk_softmax(router_logits: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, keep the top_k; weights fp32 [T, k], ids int32 [T, k]."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor,
              top_k: int, renormalize: bool, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k w_k * W2_e(silu(W1_e x) * W3_e x) over the routed experts this rank owns.

    Token-expert pairs are sorted by local expert so each expert runs one GEMM over all its tokens (a loop
    per expert, never per token). Experts mapped to -1 contribute nothing.
    """
    t, d = hidden.shape
    weights, ids = topk_softmax(router_logits, top_k, renormalize)
    local = ids.long() if expert_map is None else expert_map.long()[ids.long()]
    flat = local.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat.clamp(min=-1) + 1, minlength=w13.shape[0] + 1).tolist()
    out = torch.zeros(t, d, dtype=torch.float32, device=hidden.device)
    pairs = order[counts[0]:].split(counts[1:])  # drop the pairs of experts owned elsewhere (-1 sorts first)
    inter = w2.shape[2]
    for e, idx in enumerate(pairs):
        if idx.numel() == 0:
            continue
        tok = idx // top_k
        x = hidden.index_select(0, tok)
        gate_up = x @ w13[e].t()
        y = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2[e].t()
        out.index_add_(0, tok, y.float() * weights.reshape(-1)[idx, None])
    return out.to(hidden.dtype)
