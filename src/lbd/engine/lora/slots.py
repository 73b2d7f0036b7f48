"""The device side of LoRA: per adapted projection, every slot's A and B stacked, and the step's token map.

Each fused projection of our models (``qkv_proj`` = q/k/v, ``gate_up_proj`` = gate/up, ``o_proj``,
``down_proj``) gets one ``ProjectionLora``: A [slots, in, W] and B [slots, W, out], where W is the
sub-projections times ``--max-lora-rank`` rounded up to a power of two (the Triton kernel's tile).
Sub-projection j owns columns [j R, j R + r) of A and the same rows of B, whose columns are its own output
rows: B is block diagonal, so one shrink and one expand serve the fused matmul (the expand does n-times the
work of separate ones, which at ranks of 8..64 costs less than more calls). Scaling is folded into B when a
slot is written.

Under tensor parallelism each worker holds its shard of every slot: a column-parallel projection (q/k/v,
gate/up) keeps A whole and its own output rows of B; a row-parallel one (o, down) keeps its own input
columns of A and B whole, and its delta is added to the partial output before the all-reduce (the sum over
ranks of (x_r A_r) B is (x A) B; ``RowParallelLinear.forward``). The slicing happens when a slot is written
(``ProjectionLora.rows``/``cols``, from the projection's ``sources``/``first_column``).

A step's ``LoraStep`` (from the scheduled sequences: their slots and token counts) is set on the shared
``LoraContext`` before the forward; ``Linear.forward`` (``lbd.engine.models.layers``) then calls
``ProjectionLora.add(x, y)``, which adds the adapters' deltas in place (``lbd.engine.lora.compute``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lbd.engine.lora import compute
from lbd.engine.lora.peft import AdapterWeights, ModuleShapes

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass(slots=True)
class LoraStep:
    """One step's token -> slot map: ``groups`` lists (slot, rows) with rows a slice (one contiguous run) or
    an index tensor; ``token_slots`` [T] int32 (-1 = base) for the gather and Triton paths."""

    groups: list[tuple[int, slice | torch.Tensor]]
    token_slots: torch.Tensor
    num_tokens: int


def make_step(seq_slots: list[tuple[int, int]], device: torch.device) -> LoraStep | None:
    """From (slot, new tokens) per scheduled sequence, in batch order; None when no token is adapted."""
    runs: dict[int, list[tuple[int, int]]] = {}
    pos = 0
    for slot, n in seq_slots:
        if slot >= 0:
            spans = runs.setdefault(slot, [])
            if spans and spans[-1][1] == pos:
                spans[-1] = (spans[-1][0], pos + n)
            else:
                spans.append((pos, pos + n))
        pos += n
    if not runs:
        return None
    groups: list[tuple[int, slice | torch.Tensor]] = []
    for slot, spans in runs.items():
        if len(spans) == 1:
            groups.append((slot, slice(*spans[0])))
        else:
            idx = [i for a, b in spans for i in range(a, b)]
            groups.append((slot, torch.tensor(idx, dtype=torch.long, device=device)))
    per_seq = torch.tensor(seq_slots, dtype=torch.int32)
    token_slots = per_seq[:, 0].repeat_interleave(per_seq[:, 1].long(), output_size=pos).to(device)
    return LoraStep(groups, token_slots, pos)


@dataclass(slots=True)
class LoraContext:
    """Shared by every ``ProjectionLora`` of a model: the step being run (None: no adapted token)."""

    step: LoraStep | None = None


class ProjectionLora(nn.Module):
    """The slots' A/B of one fused projection; ``add`` is called by the projection's forward."""

    def __init__(self, ctx: LoraContext, fan_in: int, outs: list[int], slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, rows: list[tuple[int, int]] | None = None,
                 cols: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.ctx = ctx
        self.max_rank = max_rank
        self.rows = rows  # TP column-parallel: (first row, rows) of each sub-projection's B this rank holds
        self.cols = cols  # TP row-parallel: (first column, columns) of A this rank holds
        self.offsets = [sum(outs[:j]) for j in range(len(outs))]
        self.outs = outs
        width = 1 << (len(outs) * max_rank - 1).bit_length()
        self.register_buffer("lora_a", torch.zeros(slots, fan_in, width, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(slots, width, sum(outs), dtype=dtype, device=device),
                             persistent=False)

    def write(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Slot ``slot`` := the sub-projections' (A [r, in], B [out, r]) (None: not adapted)."""
        a, b, big_r = self.lora_a[slot], self.lora_b[slot], self.max_rank
        a.zero_()
        b.zero_()
        for j, part in enumerate(parts):
            if part is None:
                continue
            pa, pb = part
            if self.rows is not None:
                pb = pb[self.rows[j][0]: self.rows[j][0] + self.rows[j][1]]
            if self.cols is not None:
                pa = pa[:, self.cols[0]: self.cols[0] + self.cols[1]]
            r, off = pa.shape[0], self.offsets[j]
            a[:, j * big_r: j * big_r + r].copy_(pa.t())
            b[j * big_r: j * big_r + r, off: off + self.outs[j]].copy_(pb.t())

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        step = self.ctx.step
        if step is None or step.num_tokens != x.shape[0]:
            return y  # no adapted token (or a profiling/dummy forward)
        return compute.add_lora(y, x, self.lora_a, self.lora_b, step.groups, step.token_slots)


@dataclass(slots=True)
class LoraDevice:
    """Every adapted projection of a model: writes slots and sets the step."""

    ctx: LoraContext
    layers: list[dict[str, ProjectionLora]] = field(default_factory=list)

    def write(self, slot: int, weights: AdapterWeights) -> None:
        self.write_tensors(slot, weights.tensors)

    def write_tensors(self, slot: int, t: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot ``slot`` := (layer, projection) -> (A [r, in], B [out, r]) (absent: not adapted)."""
        for i, projections in enumerate(self.layers):
            for fused, proj in projections.items():
                proj.write(slot, [t.get((i, m)) for m in FUSED[fused]])

    def set_step(self, seq_slots: list[tuple[int, int]], device: torch.device) -> None:
        self.ctx.step = make_step(seq_slots, device)


def dense_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a dense Llama-family model (Llama, Mistral, Qwen2, Qwen3); ValueError for others
    (MoE, MLA), which have no LoRA support."""
    layers = list(getattr(getattr(model, "model", None), "local_layers", []))
    ok = layers and all(hasattr(layer, "self_attn") and hasattr(layer.self_attn, "qkv_proj")
                        and hasattr(layer, "mlp") and hasattr(layer.mlp, "gate_up_proj") for layer in layers)
    if not ok:
        raise ValueError(f"--enable-lora: {type(model).__name__} is not supported (LoRA covers the dense "
                         "Llama-family models: Llama, Mistral, Qwen2, Qwen3)")
    return layers


def module_shapes(cfg: Any) -> ModuleShapes:
    """Each PEFT target module's (in, out) in the whole base model (an ``ArchConfig``: under TP a rank's
    projections are shards, the adapter's tensors are not)."""
    hidden, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def attach(model: nn.Module, slots: int, max_rank: int, dtype: torch.dtype,
           device: torch.device) -> LoraDevice:
    """Give every projection of ``model`` its LoRA slots (``Linear.lora``)."""
    lora = LoraDevice(LoraContext())
    for layer in dense_layers(model):
        projections = {}
        for fused, owner in (("qkv_proj", layer.self_attn), ("o_proj", layer.self_attn),
                             ("gate_up_proj", layer.mlp), ("down_proj", layer.mlp)):
            lin = getattr(owner, fused)
            cols = (lin.first_column, lin.in_features) if hasattr(lin, "first_column") else None
            proj = ProjectionLora(lora.ctx, lin.in_features, list(lin.shard_sizes), slots, max_rank, dtype,
                                  device, rows=getattr(lin, "sources", None), cols=cols)
            # a plain attribute: in nn.Module's registry the class's ``Linear.lora = None`` would hide it
            lin.__dict__["lora"] = proj
            projections[fused] = proj
        lora.layers.append(projections)
    return lora


def attach_runner(runner: Any, flags: Any) -> LoraDevice:
    """Give a model runner's model ``flags.max_loras`` slots (``LoraFlags``): the runner's ``lora``, the
    model's ``lora_ctx``; CUDA graphs off (their step would need the slots as inputs: every step is eager)."""
    device = attach(runner.model, flags.max_loras, flags.max_lora_rank, runner.torch_dtype,
                    runner.torch_device)
    runner.model.lora_ctx = device.ctx
    runner.graphs = None
    runner.lora = device
    return device
