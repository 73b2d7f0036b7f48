"""Batched LoRA: y[t] += (x[t] @ A[slot[t]]) @ B[slot[t]] for every token whose slot is >= 0 (-1 = base).

Three ways, one result:
- ``add_grouped`` (the CPU path): per slot, its rows (a slice when contiguous, else gathered once) times A,
  times B, added back: two small matmuls per adapter in the step, whatever the batch's mix.
- ``add_gathered``: torch's gather path, A and B gathered per token and two ``torch.bmm``: what a naive
  implementation does; kept as the reference the fast path is measured against.
- ``lbd.engine.lora.triton_kernel.add_lora`` on CUDA (one kernel, per-token slot).

Measured (``benchmarks/lora_compute.py``; benchmarks/RESULTS.md, "LoRA in the engine"), one thread, fp32,
SmolLM2-135M's shapes, 4 adapters + base mixed: the grouped path is 4-6x faster for one decode token, 9-25x
for 32 mixed decodes and 60-190x for a 4x64-token prefill (the gather path copies an [in, W] and a [W, out]
matrix per token). So the grouped path is the CPU path; ``tests/engine/lora/test_compute.py`` keeps it faster.
"""

from __future__ import annotations

import os

import torch

# LBD_LORA_TRITON=1 sends CPU tensors to the Triton kernel too (with TRITON_INTERPRET=1: how the tests run the
# kernel inside a whole model without a GPU)
_TRITON_ON_CPU = os.environ.get("LBD_LORA_TRITON") == "1"

Group = tuple[int, "slice | torch.Tensor"]


def add_grouped(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                groups: list[Group]) -> torch.Tensor:
    for slot, rows in groups:
        if isinstance(rows, slice):  # (the scheduler orders a step's decodes by slot: one run per adapter)
            y[rows].addmm_(torch.mm(x[rows], a[slot]), b[slot])
        else:
            y.index_add_(0, rows, torch.mm(torch.mm(x.index_select(0, rows), a[slot]), b[slot]))
    return y


def add_gathered(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 token_slots: torch.Tensor) -> torch.Tensor:
    adapted = token_slots >= 0
    idx = token_slots.clamp(min=0).long()
    delta = torch.bmm(torch.bmm(x.unsqueeze(1), a[idx]), b[idx]).squeeze(1)
    return y.add_(delta * adapted.unsqueeze(1).to(delta.dtype))


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, groups: list[Group],
             token_slots: torch.Tensor) -> torch.Tensor:
    """The step's deltas added to ``y`` in place: Triton on CUDA, grouped matmuls elsewhere."""
    if y.is_cuda or _TRITON_ON_CPU:
        from lbd.engine.lora import triton_kernel

        return triton_kernel.add_lora(y, x, a, b, token_slots)
    return add_grouped(y, x, a, b, groups)
