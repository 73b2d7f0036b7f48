"""float8_e4m3fn KV-cache storage for the Triton kernels.

Mode 1 (``NATIVE``) lets Triton convert (GPUs with fp8e4nv, sm_89+, and the interpreter). Mode 2
(``SOFTWARE``) hands the kernels the cache as raw bytes and converts with integer arithmetic, for GPUs whose
Triton backend has no e4m3 type (sm_80/sm_86). Both round to nearest-even and saturate at +-448, exactly as
the torch reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NONE, NATIVE, SOFTWARE = 0, 1, 2
force_software = False  # tests set this to run the byte path under the interpreter


def fp8_mode(cache: torch.Tensor) -> int:
    if cache.dtype != torch.float8_e4m3fn:
        return NONE
    if force_software or (cache.is_cuda and torch.cuda.get_device_capability(cache.device) < (8, 9)):
        return SOFTWARE
    return NATIVE


def storage(cache: torch.Tensor, mode: int) -> torch.Tensor:
    """What the kernels are given: the cache itself, or its bytes in software mode."""
    return cache.view(torch.uint8) if mode == SOFTWARE else cache


@triton.jit
def round_to_e4m3(x):
    """Round fp32 to the nearest e4m3 value (ties to even), as fp32, saturating at 448.

    The narrowing cast that follows is then exact; rounding here rather than in the cast also sidesteps
    the CPU interpreter, which drops the carry when rounding into fp8 (124.1 -> 64)."""
    bits = x.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    ulp_exp = tl.maximum(exp, -6) - 3  # 3 mantissa bits; below 2^-6 the subnormal spacing is 2^-9
    ulp = ((ulp_exp + 127) << 23).to(tl.float32, bitcast=True)
    y = tl.abs(x) / ulp
    r = tl.floor(y + 0.5)
    tie_odd = ((r - y) == 0.5) & ((r.to(tl.int32) & 1) == 1)
    r = tl.where(tie_odd, r - 1.0, r)
    out = tl.minimum(r * ulp, 448.0)
    return tl.where(x < 0, -out, out)


@triton.jit
def e4m3_bits(r):
    """Bits (uint8) of an fp32 value already on the e4m3 grid (from ``round_to_e4m3``)."""
    a = tl.abs(r)
    abits = a.to(tl.int32, bitcast=True)
    normal = ((((abits >> 23) - 120) << 3) | ((abits >> 20) & 7))  # exponent bias 127 -> 7
    sub = (a * 512.0).to(tl.int32)  # subnormals are multiples of 2^-9
    mag = tl.where(a >= 0.015625, normal, sub)
    bits = tl.where(r < 0, mag | 0x80, mag)
    return tl.where(r != r, 0x7F, bits).to(tl.uint8)


@triton.jit
def e4m3_value(b):
    """fp32 value of e4m3 bits (uint8)."""
    b = b.to(tl.int32)
    e = (b >> 3) & 0xF
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def quantise(x, scale, MODE: tl.constexpr):
    """x / scale as it is stored in an fp8 cache of the given mode (one return: the branch is static)."""
    r = round_to_e4m3(x.to(tl.float32) / scale)
    if MODE == 2:
        out = e4m3_bits(r)
    else:
        out = r
    return out


@triton.jit
def dequantise(x, scale, MODE: tl.constexpr):
    """fp32 value of what an fp8 cache of the given mode holds, times scale."""
    if MODE == 2:
        out = e4m3_value(x) * scale
    else:
        out = x.to(tl.float32) * scale
    return out
