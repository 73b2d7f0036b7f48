"""The CUDA path of batched LoRA: one Triton kernel, per token its slot (-1 = base, skipped).

Program (t, n): token t, output columns [n BLOCK_N, (n + 1) BLOCK_N). It reduces x[t] @ A[slot] over the
input in BLOCK_K tiles (a [W] vector; W, the slot width, is a power of two), then multiplies by its tile of
B[slot] and adds into y. The shrink is recomputed per column tile: W is small (8..512) and the input row is
read from cache, which keeps the kernel one launch with no scratch buffer. fp32 accumulation.

Checked under ``TRITON_INTERPRET=1`` on the CPU (tests/engine/lora/test_compute.py): against the per-token
reference, and inside the engine (``LBD_LORA_TRITON=1``: the same greedy tokens as the grouped path for two
adapters and the base model in one batch). Not yet run on a GPU (none was lent while it was written).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_kernel(x_ptr, a_ptr, b_ptr, y_ptr, slots_ptr, fan_in, fan_out, stride_x, stride_y,
                 stride_as, stride_ak, stride_bs, stride_bw, width: tl.constexpr, block_k: tl.constexpr,
                 block_n: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        w = tl.arange(0, width)
        acc = tl.zeros([width], dtype=tl.float32)
        for k0 in range(0, fan_in, block_k):
            k = k0 + tl.arange(0, block_k)
            xk = tl.load(x_ptr + t * stride_x + k, mask=k < fan_in, other=0.0).to(tl.float32)
            ak = tl.load(a_ptr + slot * stride_as + k[:, None] * stride_ak + w[None, :],
                         mask=k[:, None] < fan_in, other=0.0).to(tl.float32)
            acc += tl.sum(xk[:, None] * ak, axis=0)
        cols = n * block_n + tl.arange(0, block_n)
        bt = tl.load(b_ptr + slot * stride_bs + w[:, None] * stride_bw + cols[None, :],
                     mask=cols[None, :] < fan_out, other=0.0).to(tl.float32)
        out = tl.sum(acc[:, None] * bt, axis=0)
        yp = y_ptr + t * stride_y + cols
        old = tl.load(yp, mask=cols < fan_out, other=0.0)
        tl.store(yp, (old.to(tl.float32) + out).to(old.dtype), mask=cols < fan_out)


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             token_slots: torch.Tensor, block_k: int | None = None,
             block_n: int | None = None) -> torch.Tensor:
    """y [T, out] += per token (x [T, in] @ a[slot] [in, W]) @ b[slot] [W, out]; in place. The tiles
    shrink as W grows, so a tile stays within 8K values (registers) at every --max-lora-rank."""
    num_tokens, fan_out = y.shape
    if num_tokens == 0:
        return y
    tile = max(16, min(64, 8192 // a.shape[2]))
    block_k, block_n = block_k or tile, block_n or tile
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    assert y.stride(1) == 1 and token_slots.numel() == num_tokens
    grid = (num_tokens, triton.cdiv(fan_out, block_n))
    _lora_kernel[grid](x, a, b, y, token_slots, x.shape[1], fan_out, x.stride(0), y.stride(0), a.stride(0),
                       a.stride(1), b.stride(0), b.stride(1), width=a.shape[2], block_k=block_k,
                       block_n=block_n)
    return y
