"""Paged attention for a mixed batch: split-KV decode for the leading decodes, varlen prefill for the rest."""

from __future__ import annotations

import functools

import torch
import triton

from lbd.kernels.metadata import AttentionMetadata
from lbd.kernels.triton_ops.attention_kernels import (
    LOG2E,
    decode_kernel,
    prefill_kernel,
    reduce_splits_kernel,
    zero_tail_kernel,
)
from lbd.kernels.triton_ops.fp8 import fp8_mode, storage


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise run as tf32 on GPUs (~1e-3 error); half types ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def choose_num_splits(query: torch.Tensor, num_decodes: int, kv_heads: int, max_seq_len: int,
                      block_n: int) -> int:
    """Enough (sequence, kv head, split) programs to fill the GPU, no split shorter than 4 key tiles.

    Only performance depends on this: the kernel divides each sequence's keys among the splits itself."""
    by_length = max(1, triton.cdiv(max_seq_len, 4 * block_n))
    programs = max(1, num_decodes * kv_heads)
    target = 2 * _num_sms(query.device.index or 0) if query.is_cuda else 4
    return int(min(16, by_length, max(1, triton.cdiv(target, programs))))


def _prefill_blocks(head_dim_pad: int, on_gpu: bool) -> tuple[int, int]:
    if not on_gpu:
        return 16, 16  # the interpreter's cost grows with tile area
    return (64, 64) if head_dim_pad <= 64 else (64, 32)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                    *, out: torch.Tensor | None = None, num_splits: int | None = None,
                    block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    n_tokens, heads, head_dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("paged_attention needs K/V caches of one layout, dense along head_dim")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device) if out is None else out
    if out.stride() != (heads * head_dim, head_dim, 1):
        raise ValueError("paged_attention writes a contiguous out [T, H, d]")
    if n_tokens == 0:
        return out
    group = heads // kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    qk_scale = scale * LOG2E
    mode = fp8_mode(key_cache)
    kc, vc = storage(key_cache, mode), storage(value_cache, mode)
    prec = _dot_precision(query.dtype)
    strides = (query.stride(0), query.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
               key_cache.stride(0), key_cache.stride(1), key_cache.stride(2))
    common = dict(HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size, FP8=mode, DOT_PREC=prec)
    nd, n_seqs = meta.num_decodes, meta.num_seqs
    if nd:
        bn = block_n or (16 if not query.is_cuda else 64)
        splits = num_splits or choose_num_splits(query, nd, kv_heads, meta.max_seq_len, bn)
        if splits > 1:
            part = torch.empty(nd, heads, splits, d_pad, dtype=torch.float32, device=query.device)
            lse = torch.empty(nd, heads, splits, dtype=torch.float32, device=query.device)
        else:
            part = lse = out  # unused
        decode_kernel[(nd, kv_heads, splits)](
            query, kc, vc, out, part, lse, meta.block_tables, meta.seq_lens, *strides,
            qk_scale, float(k_scale), float(v_scale), GROUP=group,
            G_PAD=max(16, triton.next_power_of_2(group)), BLOCK_N=bn, NUM_SPLITS=splits, **common)
        if splits > 1:
            reduce_splits_kernel[(nd, heads)](part, lse, out, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
                                              D_PAD=d_pad, NUM_SPLITS=splits,
                                              S_PAD=triton.next_power_of_2(splits))
    if n_seqs > nd:
        bm, bn = _prefill_blocks(d_pad, query.is_cuda)
        bm, bn = block_m or bm, block_n or bn
        grid = (triton.cdiv(meta.max_query_len, bm), n_seqs - nd, heads)
        prefill_kernel[grid](query, kc, vc, out, meta.block_tables, meta.seq_lens,
                             meta.query_start_loc, nd, *strides, qk_scale, float(k_scale), float(v_scale),
                             GROUP=group, BLOCK_M=bm, BLOCK_N=bn, **common)
    row = heads * head_dim
    zero_tail_kernel[(1,)](out, meta.query_start_loc, n_seqs, n_tokens, out.stride(0), row,
                           BLOCK=min(1024, triton.next_power_of_2(row)))
    return out
