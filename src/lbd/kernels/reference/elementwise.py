"""RMSNorm (optionally fused with the residual add) and SiLU-and-mul in plain torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 like transformers, scale by the weight in the activation dtype.
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return normed * weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is None:
        return _norm(x, weight, eps)
    new_residual = x + residual
    return _norm(new_residual, weight, eps), new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]
