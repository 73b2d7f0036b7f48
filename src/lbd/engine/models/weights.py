"""Where a checkpoint tensor goes when its name or layout differs from our parameters.

A model that stacks or renames weights (MoE experts stacked as w13 [E, 2I, D] / w2 [E, D, I], Mixtral's
``block_sparse_moe`` prefix) answers ``checkpoint_slots(name)`` with the slots a checkpoint tensor fills:
a part of one of our parameters (``dst`` cuts) receives a part of the tensor (``src`` cuts). The loader
copies, checks shapes, and counts covered elements per parameter, so a parameter is complete exactly when
its slots cover it. An empty list means "known, not for this rank" (an expert another rank owns).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (dim, start, length): narrow(dim, start, length); length None = select(dim, start) (drops the dim)
Cut = tuple[int, int, int | None]


def cut(t: torch.Tensor, cuts: tuple[Cut, ...]) -> torch.Tensor:
    for dim, start, length in cuts:
        t = t.select(dim, start) if length is None else t.narrow(dim, start, length)
    return t


@dataclass(frozen=True, slots=True)
class WeightSlot:
    param: str  # our parameter's name (as in named_parameters())
    dst: tuple[Cut, ...] = ()  # the part of the parameter this tensor fills
    src: tuple[Cut, ...] = ()  # the part of the checkpoint tensor that goes there

    def target(self, param: torch.Tensor) -> torch.Tensor:
        return cut(param, self.dst)

    def source(self, tensor: torch.Tensor) -> torch.Tensor:
        return cut(tensor, self.src)
