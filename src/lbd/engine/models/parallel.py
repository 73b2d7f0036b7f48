"""Megatron-style tensor-parallel layers, and the placeholder for layers another pipeline stage holds.

Column-parallel linears split their output rows across the TP ranks (each fused shard, e.g. q/k/v or
gate/up, separately), so they need no communication; row-parallel linears split their input columns and sum
their partial outputs with one all-reduce (a bias is added once, after it). The vocabulary-parallel embedding
splits the vocabulary rows (padded to a multiple of TP) and all-reduces the looked-up rows; the LM head uses
the same split and gathers the logits of the sampled rows only, to TP rank 0, which samples.

KV heads: with at least as many KV heads as TP ranks each rank takes ``num_kv_heads / TP`` of them; with
fewer, each rank takes the one KV head its query heads read (KV heads are replicated, as vLLM does).

How a parameter shards is declared by its module's ``source_slice(leaf, shard) -> (dim, start, length)``:
the part of the checkpoint tensor this rank holds. The loader reads only that slice from safetensors and
copies it into the first ``length`` entries of the parameter along ``dim``; modules without the method take
whole tensors. With TP = 1 the factories below return the plain layers of ``lbd.engine.models.layers``: a
single-device model holds no parallel layer at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lbd.engine.distributed.context import ParallelContext
from lbd.engine.distributed.groups import ProcessGroups
from lbd.engine.models.layers import Embedding, Linear
from lbd.kernels import ops

Source = tuple[int, int]  # (first row, rows) of a checkpoint tensor


class Absent(nn.Module):
    """Stands in for a module another pipeline stage holds (keeps checkpoint names and layer indices)."""

    is_absent = True


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    return max(1, num_kv_heads // tp_size)


def qkv_sources(num_heads: int, num_kv_heads: int, head_dim: int, tp_rank: int, tp_size: int) -> list[Source]:
    """Rows of q_proj, k_proj and v_proj that TP rank ``tp_rank`` holds."""
    hq = num_heads // tp_size
    hk = kv_heads_per_rank(num_kv_heads, tp_size)
    first_kv = tp_rank * hk if num_kv_heads >= tp_size else tp_rank // (tp_size // num_kv_heads)
    kv = (first_kv * head_dim, hk * head_dim)
    return [(tp_rank * hq * head_dim, hq * head_dim), kv, kv]


def even_sources(sizes: list[int], tp_rank: int, tp_size: int) -> list[Source]:
    return [(tp_rank * (s // tp_size), s // tp_size) for s in sizes]


class ColumnParallelLinear(Linear):
    """This rank's output rows of each fused shard; the forward is Linear's (no communication)."""

    def __init__(self, in_features: int, sources: list[Source], bias: bool = False) -> None:
        super().__init__(in_features, [rows for _, rows in sources], bias)
        self.sources = sources

    def source_slice(self, leaf: str, shard: int) -> tuple[int, int, int]:
        start, rows = self.sources[shard]
        return 0, start, rows


class RowParallelLinear(Linear):
    """This rank's input columns; partial outputs are summed over the TP group, then the bias is added."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int,
                 groups: ProcessGroups) -> None:
        local = in_features // groups.layout.tp_size
        super().__init__(local, out_features, bias)
        self.first_column = tp_rank * local
        self.groups = groups

    def source_slice(self, leaf: str, shard: int) -> tuple[int, int, int] | None:
        return (1, self.first_column, self.weight.shape[1]) if leaf == "weight" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.linear(x, self.weight)
        if self.lora is not None:  # LoRA's partial delta (this rank's columns of A) joins the same all-reduce
            y = self.lora.add(x, y)
        y = self.groups.tp_all_reduce(y)
        return y if self.bias is None else y.add_(self.bias)


class VocabParallelEmbedding(Embedding):
    """Rows [start, start + rows) of the vocabulary (the last rank's share is zero-padded to the others')."""

    def __init__(self, vocab_size: int, dim: int, tp_rank: int, groups: ProcessGroups) -> None:
        per_rank = -(-vocab_size // groups.layout.tp_size)
        super().__init__(per_rank, dim)
        self.vocab_size = vocab_size
        self.start = tp_rank * per_rank
        self.rows = max(0, min(vocab_size, self.start + per_rank) - self.start)
        self.groups = groups
        with torch.no_grad():
            self.weight[self.rows:].zero_()

    def source_slice(self, leaf: str, shard: int) -> tuple[int, int, int]:
        return 0, self.start, self.rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)
        return self.groups.tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head of the last pipeline stage when it cannot share the embedding (tied weights with PP)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        raise TypeError("ParallelLMHead computes logits (vocab_logits), it does not embed")


def vocab_logits(hidden: torch.Tensor, head: VocabParallelEmbedding) -> torch.Tensor | None:
    """Logits [N, V] of the sampled rows on TP rank 0 (None on the others): each rank's vocabulary slice,
    gathered."""
    full = head.groups.tp_gather(ops.linear(hidden, head.weight), dim=-1)
    return None if full is None else full[:, : head.vocab_size]


# ---- factories: the plain layers when TP = 1 -------------------------------------------------------------


def qkv_linear(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
               ctx: ParallelContext) -> Linear:
    if ctx.tp_size == 1:
        kv = num_kv_heads * head_dim
        return Linear(hidden, [num_heads * head_dim, kv, kv], bias=bias)
    return ColumnParallelLinear(hidden, qkv_sources(num_heads, num_kv_heads, head_dim, ctx.tp_rank,
                                                    ctx.tp_size), bias)


def merged_linear(in_features: int, sizes: list[int], bias: bool, ctx: ParallelContext) -> Linear:
    if ctx.tp_size == 1:
        return Linear(in_features, sizes, bias=bias)
    return ColumnParallelLinear(in_features, even_sources(sizes, ctx.tp_rank, ctx.tp_size), bias)


def row_linear(in_features: int, out_features: int, bias: bool, ctx: ParallelContext) -> Linear:
    if ctx.tp_size == 1:
        return Linear(in_features, out_features, bias=bias)
    assert ctx.groups is not None
    return RowParallelLinear(in_features, out_features, bias, ctx.tp_rank, ctx.groups)


def embedding(vocab_size: int, dim: int, ctx: ParallelContext) -> Embedding:
    if ctx.tp_size == 1:
        return Embedding(vocab_size, dim)
    assert ctx.groups is not None
    return VocabParallelEmbedding(vocab_size, dim, ctx.tp_rank, ctx.groups)


def lm_head(vocab_size: int, dim: int, ctx: ParallelContext) -> nn.Module:
    if ctx.tp_size == 1:
        return Linear(dim, vocab_size)
    assert ctx.groups is not None
    return ParallelLMHead(vocab_size, dim, ctx.tp_rank, ctx.groups)
