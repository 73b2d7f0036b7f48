"""A Llama-family decoder stack as one C call per forward (``decoder.c``): the CPU's fast path for fp32
models whose layers are exactly RMSNorm, a fused QKV projection, neox rotary, paged attention, an output
projection, RMSNorm and a SiLU-gated MLP, all without biases, on one device.

The model builds a ``FusedDecoder`` from its own tensors (``engine/models/llama.py`` decides when it applies);
this module knows tensors only. A step runs here when its attention fits the C kernel's one path: decodes,
and prefill chunks of sequences no longer than ``PREFILL_IN_C_MAX_LEN`` (each token a decode over its causal
prefix); other steps take the caller's layer-by-layer path. While the step profiler runs (``timing_sink``),
the C code times its attention and linear kernels so a profile splits the fused forward the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lbd.kernels.cpu import PREFILL_IN_C_MAX_LEN
from lbd.kernels.cpu.build import library
from lbd.kernels.cpu.packed import PackedWeight
from lbd.kernels.metadata import AttentionMetadata

# Set by the step profiler while it runs: called with ("attention" | "linear", seconds) after each fused
# forward, so a profile splits the fused forward like the layer-by-layer one.
timing_sink: Callable[[str, float], None] | None = None


@dataclass(slots=True)
class DecoderDims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rot_dim: int
    eps: float
    scale: float


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: PackedWeight  # [(heads + 2 kv_heads) head_dim, hidden]
    o_proj: PackedWeight  # [hidden, heads head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: PackedWeight  # [2 intermediate, hidden]
    down: PackedWeight  # [hidden, intermediate]


def usable(step: AttentionMetadata, num_tokens: int) -> bool:
    """Whether this step's attention is the C kernel's one path: every token is a decode or a token of a
    prefill no longer than PREFILL_IN_C_MAX_LEN, no token is padding, and there is at least one."""
    qlens, seq_lens = step.query_lens_cpu, step.seq_lens_cpu
    if not num_tokens or qlens is None or seq_lens is None or sum(qlens) != num_tokens:
        return False
    nd = step.num_decodes
    return all(n == 1 or s <= PREFILL_IN_C_MAX_LEN for n, s in zip(qlens[nd:], seq_lens[nd:], strict=True))


class FusedDecoder:
    """The layers' weights (kept alive here) and the pointer table ``decoder.c`` walks."""

    def __init__(self, dims: DecoderDims, layers: list[LayerWeights], final_norm: torch.Tensor,
                 cos_sin: torch.Tensor) -> None:
        if not layers:
            raise ValueError("a fused decoder needs at least one layer")
        self.dims = dims
        self.layers = layers
        self.final_norm = final_norm.contiguous()
        self.cos_sin = cos_sin.contiguous()
        self._dims = torch.tensor([dims.hidden, dims.heads, dims.kv_heads, dims.head_dim, dims.intermediate,
                                   0, dims.rot_dim], dtype=torch.int64)  # [5]: the caches' block size
        self._weights = [[w.input_norm.data_ptr(), w.qkv.data.data_ptr(), w.o_proj.data.data_ptr(),
                          w.post_norm.data_ptr(), w.gate_up.data.data_ptr(), w.down.data.data_ptr()]
                         for w in layers]
        self._table: torch.Tensor | None = None
        self._table_key: tuple[int, int] | None = None

    def _pointers(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """[layers, 8] int64: each layer's weights and caches (rebuilt only when the caches change)."""
        key = (kv_caches[0][0].data_ptr(), len(kv_caches))
        if self._table is None or key != self._table_key:
            rows = [w + [kc.data_ptr(), vc.data_ptr()] for w, (kc, vc) in zip(self._weights, kv_caches,
                                                                               strict=True)]
            self._table, self._table_key = torch.tensor(rows, dtype=torch.int64), key
            self._dims[5] = kv_caches[0][0].shape[1]  # block size
        return self._table

    def forward(self, embeddings: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """embeddings [T, hidden] (consumed: it becomes the residual stream) -> the final norm's output
        [T, hidden]. Only for steps ``usable`` says yes to, over fp32 caches [blocks, block_size, kv_heads,
        head_dim]."""
        lib = library()
        assert lib is not None
        d = self.dims
        t = embeddings.shape[0]
        if meta.num_decodes == len(meta.query_lens_cpu or ()):  # decode-only: a row per sequence
            tables, lens = meta.block_tables, meta.seq_lens
        else:  # a decode's row, or a prefill token's: its sequence's table, its own causal length
            seq_of_row = torch.repeat_interleave(torch.arange(len(meta.query_lens_cpu)),
                                                 torch.tensor(meta.query_lens_cpu), output_size=t)
            tables, lens = meta.block_tables.index_select(0, seq_of_row), (positions + 1).to(torch.int32)
        tables, lens = tables.to(torch.int32).contiguous(), lens.to(torch.int32).contiguous()
        pos = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        res = embeddings.contiguous()
        f32 = torch.float32
        h, out = torch.empty((t, d.hidden), dtype=f32), torch.empty((t, d.hidden), dtype=f32)
        qkv = torch.empty((t, (d.heads + 2 * d.kv_heads) * d.head_dim), dtype=f32)
        attn = torch.empty((t, d.heads * d.head_dim), dtype=f32)
        gate_up = torch.empty((t, 2 * d.intermediate), dtype=f32)
        act = torch.empty((t, d.intermediate), dtype=f32)
        sink = timing_sink
        times = torch.zeros(2, dtype=torch.float64) if sink is not None else None
        code = lib.lbd_decoder_f32(
            self._pointers(kv_caches).data_ptr(), len(self.layers), self._dims.data_ptr(), d.eps, d.scale,
            self.cos_sin.data_ptr(), self.final_norm.data_ptr(), t, pos.data_ptr(), slots.data_ptr(),
            tables.data_ptr(), tables.stride(0), lens.data_ptr(), meta.max_seq_len, res.data_ptr(),
            h.data_ptr(), out.data_ptr(), qkv.data_ptr(), attn.data_ptr(), gate_up.data_ptr(), act.data_ptr(),
            None if times is None else times.data_ptr())
        if code:
            raise MemoryError("CPU decode attention could not allocate its score buffer")
        if times is not None:  # a sink asked for the clocks
            attention, linear = times.tolist()
            sink("attention", attention)
            sink("linear", linear)
        return out
