"""Linear weights packed once for ``packed_gemm.c``, and the pass that packs a model's linear layers.

``PackedWeight`` stands where a Linear's ``weight`` Parameter stood; ``ops.linear`` sees it and runs
the packed kernel. It keeps ``shape``/``dtype``/``device`` so code that only reads those still works. Packing
happens only where a vector kernel exists at the loaded level (``build``: AVX2 or AVX-512F for fp32, AVX-512
BF16 for bf16): elsewhere the model keeps its plain weights and torch's GEMM. The packed layout is the same at
every level, and every level's build computes any packed weight (a portable loop where it has no vector
kernel), so tests run one packed weight through each level.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lbd.kernels.cpu import pages
from lbd.kernels.cpu.build import library

FP32, BF16 = 1, 2  # lbd_packed_gemm_support() bits


@dataclass(slots=True, eq=False)
class PackedWeight:
    data: torch.Tensor  # the panels (packed_gemm.c), 1-D, in the weight's dtype
    out_features: int
    in_features: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dim(self) -> int:
        return 2


def supported(dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` should be packed here: the loaded level has a vector kernel for them."""
    lib = library()
    if lib is None:
        return False
    bits = lib.lbd_packed_gemm_support()
    return (dtype == torch.float32 and bool(bits & FP32)) or (dtype == torch.bfloat16 and bool(bits & BF16))


def pack(weight: torch.Tensor) -> PackedWeight:
    """W [N, K] (fp32 or bf16, CPU, rows dense) -> its panels."""
    lib = library()
    assert lib is not None and weight.dim() == 2 and weight.stride(1) == 1
    n, k = weight.shape
    bf16 = weight.dtype == torch.bfloat16
    # on huge pages: a decode step streams every packed weight from memory (kernels/cpu/pages.py)
    out = pages.buffer(lib.lbd_packed_size(n, k, int(bf16)), weight.dtype)
    fn = lib.lbd_pack_bf16 if bf16 else lib.lbd_pack_f32
    fn(weight.data_ptr(), weight.stride(0), n, k, out.data_ptr())
    return PackedWeight(out, n, k)


def linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (rows dense, the weight's dtype) @ W^T (+ bias) -> [M, N]."""
    lib = library()
    assert lib is not None
    m, k = x.shape
    if k != w.in_features:
        raise ValueError(f"linear: x has {k} columns, the packed weight {w.in_features}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    out = torch.empty((m, w.out_features), dtype=x.dtype)
    fn = lib.lbd_packed_gemm_bf16 if x.dtype == torch.bfloat16 else lib.lbd_packed_gemm_f32
    code = fn(x.data_ptr(), x.stride(0), w.data.data_ptr(), w.out_features, k,
              None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), m)
    if code:
        raise RuntimeError(f"packed linear refused {tuple(x.shape)} x {tuple(w.shape)} ({x.dtype})")
    return out


def unpack(w: PackedWeight) -> torch.Tensor:
    """The plain [N, K] weight back (tests, and code that needs the matrix itself)."""
    n, k = w.out_features, w.in_features
    eye = torch.eye(k, dtype=w.dtype)
    return linear(eye, w).t().contiguous()[:n]
