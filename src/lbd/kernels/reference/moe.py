"""MoE routing (top-k softmax, DeepSeek's group-limited top-k) and the fused expert block in torch.

Routing and expert compute are separate calls: expert parallelism dispatches the routed (token, expert)
pairs to the ranks that own the experts between the two. ``fused_moe`` is the two in one.
"""

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


def grouped_topk(router_logits: torch.Tensor, top_k: int, num_groups: int, topk_groups: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's ``group_limited_greedy``: experts form ``num_groups`` equal groups; only the
    ``topk_groups`` groups with the highest single-expert probability compete for the top_k.

    Sync-free torch (graph-capturable on CUDA); weights fp32 [T, k], ids int32 [T, k].
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    t, e = probs.shape
    if e % num_groups:
        raise ValueError(f"{e} experts do not split into {num_groups} groups")
    group_best = probs.view(t, num_groups, e // num_groups).amax(dim=-1)
    chosen = torch.topk(group_best, topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_best, dtype=torch.bool).scatter_(1, chosen, True)
    probs = probs.masked_fill(~keep.repeat_interleave(e // num_groups, dim=1), 0.0)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k w_k * W2_e(silu(W1_e x) * W3_e x) over the routed experts this rank owns.

    ``topk_ids`` are global expert ids; ``expert_map[g]`` is the local index of global expert g in w13/w2,
    or -1 when another rank owns it (such pairs contribute nothing). Token-expert pairs are sorted by local
    expert so each expert runs one GEMM over all its tokens (a loop per expert, never per token).
    """
    t, d = hidden.shape
    top_k = topk_ids.shape[1]
    local = topk_ids.long() if expert_map is None else expert_map.long()[topk_ids.long()]
    flat = local.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat.clamp(min=-1) + 1, minlength=w13.shape[0] + 1).tolist()
    out = torch.zeros(t, d, dtype=torch.float32, device=hidden.device)
    pairs = order[counts[0]:].split(counts[1:])  # drop the pairs of experts owned elsewhere (-1 sorts first)
    inter = w2.shape[2]
    weights = topk_weights.reshape(-1)
    for e, idx in enumerate(pairs):
        if idx.numel() == 0:
            continue
        tok = idx // top_k
        x = hidden.index_select(0, tok)
        gate_up = x @ w13[e].t()
        y = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2[e].t()
        out.index_add_(0, tok, y.float() * weights[idx, None].float())
    return out.to(hidden.dtype)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor,
              top_k: int, renormalize: bool, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k softmax routing followed by ``fused_experts``."""
    weights, ids = topk_softmax(router_logits, top_k, renormalize)
    return fused_experts(hidden, w13, w2, weights, ids, expert_map)
