"""RMSNorm (with an optional fused residual add) and SiLU-and-mul: one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro,
                     n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        # The sum is rounded to the activation dtype first, exactly as the residual stream stores it.
        x = x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (xf * rstd).to(x.dtype) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-D view whose rows may be strided but whose columns are dense."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             *, out: torch.Tensor | None = None,
             residual_out: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device) if out is None else out
    o2 = out.view(-1, n_cols)
    block = triton.next_power_of_2(n_cols)
    warps = min(16, max(1, block // 256))
    if residual is None:
        if n_rows:
            _rms_norm_kernel[(n_rows,)](x2, x2, weight, o2, o2, x2.stride(0), 0, o2.stride(0), 0, n_cols, eps,
                                        HAS_RES=False, BLOCK=block, num_warps=warps)
        return out
    r2 = _rows(residual)
    new_res = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual_out is None else residual_out
    nr2 = new_res.view(-1, n_cols)
    if n_rows:
        _rms_norm_kernel[(n_rows,)](x2, r2, weight, o2, nr2, x2.stride(0), r2.stride(0), o2.stride(0),
                                    nr2.stride(0), n_cols, eps, HAS_RES=True, BLOCK=block, num_warps=warps)
    return out, new_res


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    x2 = _rows(x)
    n_rows, inter = x2.shape[0], x2.shape[1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device) if out is None else out
    o2 = out.view(-1, inter)
    block = min(1024, triton.next_power_of_2(inter))
    if n_rows == 0:
        return out
    _silu_and_mul_kernel[(n_rows, triton.cdiv(inter, block))](x2, o2, x2.stride(0), o2.stride(0), inter,
                                                             BLOCK=block)
    return out
