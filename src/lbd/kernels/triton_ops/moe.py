"""Top-k softmax routing and the fused MoE block: expert-grouped GEMMs over sorted token-expert pairs.

Pairs (token, k) are sorted by local expert and each expert's run is padded to a multiple of BLOCK_M, so a
GEMM program works on BLOCK_M rows of one expert. The layout is computed with sync-free torch ops into
buffers sized by host ints (T * top_k + E * (BLOCK_M - 1) rows at most), so the whole block is
graph-capturable. Pairs routed to experts another rank owns (expert_map -1) are never scheduled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _topk_softmax_kernel(logits_ptr, w_ptr, ids_ptr, stride_l, n_experts, TOP_K: tl.constexpr,
                         K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    x = tl.load(logits_ptr + row * stride_l + offs, mask=offs < n_experts, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(offs < n_experts, p, -1.0)
    slots = tl.arange(0, K_PAD)
    weights = tl.zeros([K_PAD], tl.float32)
    ids = tl.zeros([K_PAD], tl.int32)
    for j in tl.static_range(TOP_K):  # selection by repeated argmax, kept in registers
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs, E_PAD), axis=0)  # lowest index among ties, like torch.topk
        weights = tl.where(slots == j, best, weights)
        ids = tl.where(slots == j, idx, ids)
        p = tl.where(offs == idx, -1.0, p)
    if RENORM:
        weights = weights / tl.sum(weights, axis=0)
    tl.store(w_ptr + row * TOP_K + slots, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slots, ids, mask=slots < TOP_K)


def topk_softmax(router_logits: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    t, e = router_logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
    if t:
        logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
        _topk_softmax_kernel[(t,)](logits, weights, ids, logits.stride(0), e, TOP_K=top_k,
                                   K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(e),
                                   RENORM=renormalize)
    return weights, ids


def align_by_expert(local_ids: torch.Tensor, n_local: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_expert): pair indices grouped by expert, each group padded to block_m with the
    sentinel ``n_pairs``; block_expert[b] = the expert of rows b*block_m.., or -1 past the last group."""
    flat = local_ids.reshape(-1).long()
    n_pairs = flat.numel()
    max_rows = n_pairs + n_local * (block_m - 1)
    n_blocks = triton.cdiv(max_rows, block_m)
    dev = flat.device
    bucket = flat + 1  # -1 (owned elsewhere) -> bucket 0
    counts = torch.zeros(n_local + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, bucket, torch.ones_like(flat))
    padded = (counts[1:] + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    order = torch.sort(bucket, stable=True).indices
    sorted_bucket = bucket[order]
    raw_start = torch.cumsum(counts, 0) - counts  # first sorted position of each bucket
    rank = torch.arange(n_pairs, device=dev) - raw_start[sorted_bucket]
    expert = (sorted_bucket - 1).clamp(min=0)
    dest = torch.where(sorted_bucket > 0, pad_start[expert] + rank, max_rows)  # elsewhere -> dump slot
    sorted_pairs = torch.full((max_rows + 1,), n_pairs, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(n_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, starts, right=True)
    block_expert = torch.where(block_expert < n_local, block_expert, -1).to(torch.int32)
    return sorted_pairs[:max_rows], block_expert


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, pairs_ptr, block_expert_ptr, n_pairs, dim, inter, stride_x,
                    stride_we, stride_wn, stride_a, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """act[pair, n] = silu(x[tok] . W1_e[n]) * (x[tok] . W3_e[n]) for BLOCK_M pairs of one expert."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pairs < n_pairs
    tok = (pairs // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, dim, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < dim
        a = tl.load(x_ptr + tok[:, None] * stride_x + kk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        wmask = k_mask[:, None] & n_mask[None, :]
        wg = tl.load(w_base + offs_n[None, :] * stride_wn + kk[:, None], mask=wmask, other=0.0)
        wu = tl.load(w_base + (offs_n + inter)[None, :] * stride_wn + kk[:, None], mask=wmask, other=0.0)
        gate = tl.dot(a, wg, gate, input_precision=DOT_PREC)
        up = tl.dot(a, wu, up, input_precision=DOT_PREC)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + pairs.to(tl.int64)[:, None] * stride_a + offs_n[None, :],
             act.to(act_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, out_ptr, weights_ptr, pairs_ptr, block_expert_ptr, n_pairs, dim, inter,
                 stride_a, stride_we, stride_wn, stride_o, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """out[pair, n] = routing_weight[pair] * (act[pair] . W2_e[n])."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pairs < n_pairs
    rows = pairs.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < dim
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < inter
        a = tl.load(act_ptr + rows[:, None] * stride_a + kk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        wmask = k_mask[:, None] & n_mask[None, :]
        w = tl.load(w_base + offs_n[None, :] * stride_wn + kk[:, None], mask=wmask, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
    rw = tl.load(weights_ptr + rows, mask=m_mask, other=0.0)
    tl.store(out_ptr + rows[:, None] * stride_o + offs_n[None, :], acc * rw[:, None],
             mask=m_mask[:, None] & n_mask[None, :])


def _gemm_blocks(on_gpu: bool) -> tuple[int, int, int]:
    return (64, 64, 32) if on_gpu else (16, 32, 32)


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None,
                  *, block_m: int | None = None) -> torch.Tensor:
    """The routed experts of ``reference.moe.fused_experts``: global ids, ``expert_map`` to local."""
    t, dim = hidden.shape
    top_k = topk_ids.shape[1]
    n_local, inter = w13.shape[0], w2.shape[2]
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("fused_moe needs expert weights dense along their last dimension")
    x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    weights = topk_weights.float().contiguous()
    local = topk_ids if expert_map is None else expert_map[topk_ids.long()]
    bm, bn, bk = _gemm_blocks(hidden.is_cuda)
    bm = block_m or bm
    pairs, block_expert = align_by_expert(local, n_local, bm)
    n_pairs = t * top_k
    prec = "ieee" if hidden.dtype == torch.float32 else "tf32"
    act = torch.empty(n_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    # Pairs no GEMM visits (owned by another rank) must add nothing to the sum over k.
    per_pair = torch.zeros(n_pairs, dim, dtype=torch.float32, device=hidden.device)
    n_blocks = block_expert.shape[0]
    if n_pairs:
        _gate_up_kernel[(n_blocks, triton.cdiv(inter, bn))](
            x, w13, act, pairs, block_expert, n_pairs, dim, inter, x.stride(0), w13.stride(0), w13.stride(1),
            act.stride(0), TOP_K=top_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=prec)
        _down_kernel[(n_blocks, triton.cdiv(dim, bn))](
            act, w2, per_pair, weights, pairs, block_expert, n_pairs, dim, inter, act.stride(0), w2.stride(0),
            w2.stride(1), per_pair.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=prec)
    return per_pair.view(t, top_k, dim).sum(1).to(hidden.dtype)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor,
              top_k: int, renormalize: bool, expert_map: torch.Tensor | None = None,
              *, block_m: int | None = None) -> torch.Tensor:
    weights, ids = topk_softmax(router_logits, top_k, renormalize)
    return fused_experts(hidden, w13, w2, weights, ids, expert_map, block_m=block_m)
