"""Scatter new K/V rows into the paged cache by slot (slot -1 = padding), quantising to fp8 when asked."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lbd.kernels.triton_ops.fp8 import fp8_mode, quantise, storage


@triton.jit
def _store_row(src_ptr, dst_ptr, tok, slot, stride_t, stride_h, stride_slot, scale, offs, n_heads,
               HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    h = offs // HEAD_DIM
    d = offs % HEAD_DIM
    mask = h < n_heads
    x = tl.load(src_ptr + tok * stride_t + h * stride_h + d, mask=mask, other=0.0)
    if FP8:
        x = quantise(x, scale, FP8)
    tl.store(dst_ptr + slot * stride_slot + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_slot, n_heads, k_scale, v_scale, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                     FP8: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    _store_row(k_ptr, kc_ptr, tok, slot, stride_kt, stride_kh, stride_slot, k_scale, offs, n_heads, HEAD_DIM,
               FP8)
    _store_row(v_ptr, vc_ptr, tok, slot, stride_vt, stride_vh, stride_slot, v_scale, offs, n_heads, HEAD_DIM,
               FP8)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    n = slot_mapping.shape[0]
    if n == 0:
        return
    _, _, n_heads, head_dim = key_cache.shape
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("write_kv_cache needs contiguous caches [blocks, block_size, kv_heads, head_dim]")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("write_kv_cache needs key/value dense along head_dim")
    row = n_heads * head_dim
    block = min(1024, triton.next_power_of_2(row))
    mode = fp8_mode(key_cache)
    _write_kv_kernel[(n, triton.cdiv(row, block))](
        key, value, storage(key_cache, mode), storage(value_cache, mode), slot_mapping, key.stride(0),
        key.stride(1), value.stride(0), value.stride(1), row, n_heads, float(k_scale), float(v_scale),
        HEAD_DIM=head_dim, BLOCK=block, FP8=mode)
