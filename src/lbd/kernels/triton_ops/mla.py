"""MLA on CUDA: the latent-cache write and the weight-absorbed split-KV decode; prefill runs the reference.

Decode grid (decode sequences, head blocks, splits): one program loads each latent tile [BLOCK_N, L + R]
once for BLOCK_H query heads (MLA's point: every head reads the same single-"head" latent rows), scores
q_lat . c_kv + q_pe . k_pe, and accumulates sum p c_kv in latent space. Splits divide each sequence's keys
at run time and merge through ``reduce_splits_kernel`` (shared with paged attention), so one launch
shape serves every length and the whole decode is CUDA-graph capturable. Prefill chunks run
``lbd.kernels.reference.mla.mla_prefill`` (torch SDPA over the expanded latents) on every device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lbd.kernels.metadata import AttentionMetadata
from lbd.kernels.triton_ops.attention import choose_num_splits
from lbd.kernels.triton_ops.attention_kernels import (
    LOG2E,
    finish_split,
    online_softmax_step,
    reduce_splits_kernel,
)

__all__ = ["mla_decode", "write_mla_cache"]


@triton.jit
def _write_mla_kernel(kvc_ptr, kpe_ptr, cache_ptr, slot_ptr, stride_c, stride_p, stride_slot,
                      LORA: tl.constexpr, ROPE: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    offs_l = tl.arange(0, L_PAD)
    offs_r = tl.arange(0, R_PAD)
    c = tl.load(kvc_ptr + tok * stride_c + offs_l, mask=offs_l < LORA, other=0.0)
    p = tl.load(kpe_ptr + tok * stride_p + offs_r, mask=offs_r < ROPE, other=0.0)
    dst = cache_ptr + slot * stride_slot
    tl.store(dst + offs_l, c.to(cache_ptr.dtype.element_ty), mask=offs_l < LORA)
    tl.store(dst + LORA + offs_r, p.to(cache_ptr.dtype.element_ty), mask=offs_r < ROPE)


def write_mla_cache(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    n = slot_mapping.shape[0]
    if n == 0:
        return
    lora, rope = kv_c.shape[-1], k_pe.shape[-1]
    if not cache.is_contiguous() or cache.shape[-1] != lora + rope:
        raise ValueError("write_mla_cache needs a contiguous cache [blocks, block_size, kv_lora_rank + rope]")
    if kv_c.stride(-1) != 1 or k_pe.stride(-1) != 1:
        raise ValueError("write_mla_cache needs kv_c and k_pe dense along their last dimension")
    _write_mla_kernel[(n,)](kv_c, k_pe, cache, slot_mapping, kv_c.stride(0), k_pe.stride(0), cache.stride(1),
                            LORA=lora, ROPE=rope, L_PAD=triton.next_power_of_2(lora),
                            R_PAD=triton.next_power_of_2(rope))


@triton.jit
def _mla_decode_kernel(q_ptr, cache_ptr, out_ptr, part_ptr, lse_ptr, bt_ptr, seq_lens_ptr, n_heads,
                       stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs, qk_scale,
                       LORA: tl.constexpr, ROPE: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       NUM_SPLITS: tl.constexpr, DOT_PREC: tl.constexpr):
    seq = tl.program_id(0)
    split = tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < n_heads
    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(seq_len, start + per_split)
    offs_l = tl.arange(0, L_PAD)
    offs_r = tl.arange(0, R_PAD)
    l_mask = offs_l < LORA
    r_mask = offs_r < ROPE
    q_rows = q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + offs_l[None, :], mask=h_mask[:, None] & l_mask[None, :], other=0.0)
    q_pe = tl.load(q_rows + LORA + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, L_PAD], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for s in range(start, end, BLOCK_N):
        offs_n = s + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = cache_ptr + blk * stride_cb + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_cs
        lat = tl.load(row[:, None] + offs_l[None, :], mask=n_mask[:, None] & l_mask[None, :], other=0.0)
        kpe = tl.load(row[:, None] + LORA + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :],
                      other=0.0)
        lat = lat.to(q_lat.dtype)
        scores = tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PREC)
        scores = tl.dot(q_pe, tl.trans(kpe.to(q_pe.dtype)), scores, input_precision=DOT_PREC) * qk_scale
        m_i, l_i, acc = online_softmax_step(tl.where(n_mask[None, :], scores, float("-inf")), lat, m_i, l_i,
                                            acc, DOT_PREC)
    finish_split(acc, m_i, l_i, out_ptr + seq.to(tl.int64) * stride_ot + heads * stride_oh, part_ptr, lse_ptr,
                 (seq.to(tl.int64) * n_heads + heads) * NUM_SPLITS + split, h_mask, offs_l, l_mask, L_PAD,
                 NUM_SPLITS)


def _decode_blocks(on_gpu: bool, lora_pad: int) -> tuple[int, int]:
    """(BLOCK_H, BLOCK_N): tl.dot needs 16+; the [BLOCK_H, L] accumulator bounds the tile on a GPU."""
    if not on_gpu:
        return 16, 16
    return 16, (32 if lora_pad >= 512 else 64)


def mla_decode(query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               kv_lora_rank: int, *, num_splits: int | None = None,
               block_n: int | None = None) -> torch.Tensor:
    b, heads, width = query.shape
    rope = width - kv_lora_rank
    out = torch.empty(b, heads, kv_lora_rank, dtype=query.dtype, device=query.device)
    if b == 0:
        return out
    if query.stride(-1) != 1 or not cache.is_contiguous() or cache.shape[-1] != width:
        raise ValueError("mla_decode needs a query dense along its last dim and a contiguous [NB, BS, L + R] "
                         "cache of the query's width")
    l_pad = max(16, triton.next_power_of_2(kv_lora_rank))
    r_pad = max(16, triton.next_power_of_2(rope))
    bh, bn = _decode_blocks(query.is_cuda, l_pad)
    bn = block_n or bn
    splits = num_splits or choose_num_splits(query, b, triton.cdiv(heads, bh), meta.max_seq_len, bn)
    if splits > 1:
        part = torch.empty(b, heads, splits, l_pad, dtype=torch.float32, device=query.device)
        lse = torch.empty(b, heads, splits, dtype=torch.float32, device=query.device)
    else:
        part = lse = out  # unused
    prec = "ieee" if query.dtype == torch.float32 else "tf32"
    _mla_decode_kernel[(b, triton.cdiv(heads, bh), splits)](
        query, cache, out, part, lse, meta.block_tables, meta.seq_lens, heads, query.stride(0),
        query.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0), cache.stride(0),
        cache.stride(1), scale * LOG2E, LORA=kv_lora_rank, ROPE=rope, L_PAD=l_pad, R_PAD=r_pad, BLOCK_H=bh,
        BLOCK_N=bn, BLOCK_SIZE=cache.shape[1], NUM_SPLITS=splits, DOT_PREC=prec)
    if splits > 1:
        reduce_splits_kernel[(b, heads)](part, lse, out, out.stride(0), out.stride(1), HEAD_DIM=kv_lora_rank,
                                         D_PAD=l_pad, NUM_SPLITS=splits, S_PAD=triton.next_power_of_2(splits))
    return out
