"""Building blocks for our models: parameters allocated without random init, fused projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lbd.kernels import ops


def _empty(*shape: int) -> nn.Parameter:
    # Weights come from the checkpoint: skip the (slow, useless) random init that nn.Linear does.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b). ``shard_sizes`` lists the output rows of each checkpoint tensor fused into W (the
    loader copies q/k/v or gate/up into their row ranges), so a fused projection is one matmul. After loading,
    ``ops.pack_linear_weights`` may replace W by a packed copy for the CPU kernel (``packable_weight``)."""

    packable_weight = True
    lora = None  # LoRA slots (lbd.engine.lora.slots.ProjectionLora) under --enable-lora: y += x A B per slot

    def __init__(self, in_features: int, out_features: int | list[int], bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.shard_sizes = list(out_features) if isinstance(out_features, list) else [out_features]
        self.weight = _empty(sum(self.shard_sizes), in_features)
        self.bias = _empty(sum(self.shard_sizes)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora.add(x, y)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = _empty(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual), fused in the kernel."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.rms_norm(x, self.weight, self.eps, residual=residual)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int) -> None:
        super().__init__()
        self.weight = _empty(num, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
