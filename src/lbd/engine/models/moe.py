"""The sparse MoE block shared by Mixtral, Qwen3-MoE and DeepSeek-V2: router, routed experts, shared experts.

Routing and expert compute are two modules on purpose: ``Router`` turns hidden states into (weights fp32
[T, k], global expert ids int32 [T, k]); ``FusedExperts`` computes the experts this rank holds for given
(weights, ids). Expert parallelism puts its dispatch (send each token to the ranks owning its experts)
and combine (sum the partial outputs back) between the two; see ``SparseMoE.forward``.

Which experts a rank holds is an ``ExpertShard``: global experts [start, end) of E (uneven splits allowed),
and optionally one tensor-parallel slice of every expert's intermediate dimension. Weights are stacked,
w13 [E_local, 2 * I_local, D] (gate rows, then up rows) and w2 [E_local, D, I_local]; the checkpoint's
per-expert tensors (hub layout) or transformers 5's fused 3-D tensors are cut into them by
``moe_checkpoint_slots``, which skips experts other ranks own.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lbd.engine.models.config import ArchConfig
from lbd.engine.models.llama import MLP, DecoderLayer, LlamaForCausalLM
from lbd.engine.models.weights import WeightSlot
from lbd.kernels import ops


@dataclass(frozen=True, slots=True)
class ExpertShard:
    """The part of a layer's ``num_experts`` routed experts this rank computes (default: all of them)."""

    num_experts: int
    start: int = 0  # first global expert id held here
    end: int | None = None  # one past the last (None = num_experts)
    tp_rank: int = 0  # this rank's slice of each expert's intermediate dim, of tp_size equal slices
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop <= self.num_experts:
            raise ValueError(f"expert range [{self.start}, {self.stop}) is not inside 0..{self.num_experts}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside 0..{self.tp_size - 1}")

    @classmethod
    def even(cls, num_experts: int, rank: int, world: int) -> ExpertShard:
        """Rank ``rank`` of ``world`` expert-parallel ranks; the first E % world ranks hold one more."""
        base, extra = divmod(num_experts, world)
        start = rank * base + min(rank, extra)
        return cls(num_experts, start, start + base + (rank < extra))

    @property
    def stop(self) -> int:
        return self.num_experts if self.end is None else self.end

    @property
    def num_local(self) -> int:
        return self.stop - self.start

    @property
    def all_local(self) -> bool:
        return self.num_local == self.num_experts

    def local_index(self, expert: int) -> int | None:
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside 0..{self.num_experts - 1}")
        return expert - self.start if self.start <= expert < self.stop else None

    def expert_map(self) -> torch.Tensor | None:
        """int32 [E]: global expert -> local index, -1 where another rank holds it; None when all are here."""
        if self.all_local:
            return None
        emap = torch.full((self.num_experts,), -1, dtype=torch.int32)
        emap[self.start:self.stop] = torch.arange(self.num_local, dtype=torch.int32)
        return emap


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    num_experts: int
    top_k: int
    renormalize: bool  # weights of the chosen k divided by their sum
    grouped: bool = False  # DeepSeek's group_limited_greedy: only the best topk_groups groups compete
    num_groups: int = 1
    topk_groups: int = 1
    scaling_factor: float = 1.0  # DeepSeek's routed_scaling_factor, applied to the weights
    fp32_logits: bool = False  # DeepSeek keeps the gate in fp32 and routes on fp32 hidden states


@dataclass(frozen=True, slots=True)
class MoEConfig:
    routing: RoutingConfig
    intermediate_size: int  # per routed expert
    shared_intermediate_size: int = 0  # DeepSeek's shared experts as one MLP (0 = none)


class Router(nn.Module):
    """hidden [T, D] -> (weights fp32 [T, k], global expert ids int32 [T, k])."""

    def __init__(self, hidden_size: int, routing: RoutingConfig) -> None:
        super().__init__()
        self.routing = routing
        dtype = torch.float32 if routing.fp32_logits else torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(routing.num_experts, hidden_size, dtype=dtype),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.routing
        logits = ops.linear(x.float() if r.fp32_logits else x, self.weight)
        if r.grouped:
            weights, ids = ops.grouped_topk(logits, r.top_k, r.num_groups, r.topk_groups, r.renormalize)
        else:
            weights, ids = ops.topk_softmax(logits, r.top_k, r.renormalize)
        if r.scaling_factor != 1.0:
            weights = weights * r.scaling_factor
        return weights, ids


class FusedExperts(nn.Module):
    """The routed experts this rank holds, stacked; (hidden, weights, global ids) -> partial sum [T, D]."""

    def __init__(self, hidden_size: int, intermediate_size: int, shard: ExpertShard) -> None:
        super().__init__()
        if intermediate_size % shard.tp_size:
            raise ValueError(f"expert intermediate size {intermediate_size} does not split into "
                             f"{shard.tp_size} tensor-parallel slices")
        self.shard = shard
        self.intermediate_size = intermediate_size
        self.inter_local = intermediate_size // shard.tp_size
        empty = dict(dtype=torch.get_default_dtype())
        self.w13 = nn.Parameter(torch.empty(shard.num_local, 2 * self.inter_local, hidden_size, **empty),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(shard.num_local, hidden_size, self.inter_local, **empty),
                               requires_grad=False)
        emap = shard.expert_map()
        self.register_buffer("expert_map", None if emap is None else emap.to(self.w13.device),
                             persistent=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return ops.fused_experts(x, self.w13, self.w2, weights, ids, self.expert_map)

    def reshard(self, shard: ExpertShard) -> list[int]:
        """Hold ``shard``'s experts from now on (an elastic resize of the group): the experts both shards hold
        whole keep their weights (copied into the new stacks); returns the global experts whose weights the
        caller must load again (the new ones; all of them when the tensor-parallel slice changes)."""
        old, il = self.shard, self.intermediate_size // shard.tp_size
        if shard.num_experts != old.num_experts or self.intermediate_size % shard.tp_size:
            raise ValueError(f"cannot reshard {old} into {shard}")
        same_slice = (old.tp_rank, old.tp_size) == (shard.tp_rank, shard.tp_size)
        lo, hi = (max(old.start, shard.start), min(old.stop, shard.stop)) if same_slice else (0, 0)
        w13 = self.w13.new_empty(shard.num_local, 2 * il, self.w13.shape[2])
        w2 = self.w2.new_empty(shard.num_local, self.w2.shape[1], il)
        if lo < hi:
            w13[lo - shard.start:hi - shard.start] = self.w13[lo - old.start:hi - old.start]
            w2[lo - shard.start:hi - shard.start] = self.w2[lo - old.start:hi - old.start]
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)
        self.shard, self.inter_local = shard, il
        emap = shard.expert_map()
        self.expert_map = None if emap is None else emap.to(w13.device)
        return [e for e in range(shard.start, shard.stop) if not lo <= e < hi]

    def checkpoint_slots(self, prefix: str, weight: str, expert: int | None) -> list[WeightSlot]:
        """Slots for checkpoint tensor ``weight`` of global ``expert`` (None: the fused 3-D tensors
        ``gate_up_proj`` [E, 2I, D] / ``down_proj`` [E, D, I] of transformers 5); ``prefix`` ends in '.'."""
        shard, il = self.shard, self.inter_local
        off = shard.tp_rank * il
        w13, w2 = prefix + "w13", prefix + "w2"
        if expert is not None:
            local = shard.local_index(expert)
            if local is None:
                return []  # another rank's expert
            if weight in ("w1", "gate_proj"):
                return [WeightSlot(w13, ((0, local, None), (0, 0, il)), ((0, off, il),))]
            if weight in ("w3", "up_proj"):
                return [WeightSlot(w13, ((0, local, None), (0, il, il)), ((0, off, il),))]
            return [WeightSlot(w2, ((0, local, None),), ((1, off, il),))]
        mine = (0, shard.start, shard.num_local)
        if weight == "gate_up_proj":
            return [WeightSlot(w13, ((1, 0, il),), (mine, (1, off, il))),
                    WeightSlot(w13, ((1, il, il),), (mine, (1, self.intermediate_size + off, il)))]
        return [WeightSlot(w2, (), (mine, (2, off, il)))]


class SparseMoE(nn.Module):
    """Router -> routed experts (+ shared experts), named like the checkpoints: gate, experts,
    shared_experts."""

    def __init__(self, cfg: ArchConfig, moe: MoEConfig, shard: ExpertShard | None = None) -> None:
        super().__init__()
        self.gate = Router(cfg.hidden_size, moe.routing)
        self.experts = FusedExperts(cfg.hidden_size, moe.intermediate_size,
                                    shard or ExpertShard(moe.routing.num_experts))
        self.shared_experts = (MLP(cfg, moe.shared_intermediate_size) if moe.shared_intermediate_size
                               else None)
        # Set by a DP group (lbd.engine.dp.expert_parallel.attach): (experts, x, weights, ids) -> the summed
        # routed output of this rank's tokens, computed by the members that hold their experts.
        self.dispatch: Callable[..., torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.dispatch is None:
            out = self.experts(x, weights, ids)
        else:  # expert parallel / TP-sharded experts across DP ranks: dispatch, compute, combine
            out = self.dispatch(self.experts, x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


_PER_EXPERT = re.compile(r"^(?P<layer>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
                         r"(?P<weight>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(?P<layer>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<weight>gate_up_proj|down_proj)$")
_MIXTRAL_GATE = re.compile(r"^(?P<layer>.+)\.block_sparse_moe\.gate\.weight$")


def checkpoint_expert(name: str) -> tuple[str, int | None] | None:
    """(our experts module, the global expert or None for a fused 3-D tensor) that checkpoint tensor
    ``name`` fills, or None when it holds no routed expert."""
    m = _PER_EXPERT.match(name) or _FUSED.match(name)
    if m is None:
        return None
    return f"{m['layer']}.mlp.experts", int(m["expert"]) if "expert" in m.groupdict() else None


def moe_checkpoint_slots(model: nn.Module, name: str) -> list[WeightSlot] | None:
    """A model's ``checkpoint_slots`` for MoE checkpoints: Mixtral's ``block_sparse_moe.experts.N.w1/w2/w3``
    and Qwen3-MoE/DeepSeek's ``mlp.experts.N.gate_proj/up_proj/down_proj`` (hub layout), transformers 5's
    ``mlp.experts.gate_up_proj/down_proj`` (3-D), and Mixtral's ``block_sparse_moe.gate``. Our modules sit
    at ``<layer>.mlp.gate`` / ``<layer>.mlp.experts``. None: a name the loader maps itself."""
    m = _PER_EXPERT.match(name) or _FUSED.match(name)
    if m is None:
        gate = _MIXTRAL_GATE.match(name)
        return [WeightSlot(f"{gate['layer']}.mlp.gate.weight")] if gate else None
    module = f"{m['layer']}.mlp.experts"
    try:
        experts = model.get_submodule(module)
    except AttributeError:
        experts = None
    if not isinstance(experts, FusedExperts):
        raise ValueError(f"checkpoint tensor {name} holds experts, but {module} is not an MoE layer here: "
                         "check the config's MoE layer placement")
    expert = int(m["expert"]) if "expert" in m.groupdict() else None
    return experts.checkpoint_slots(module + ".", m["weight"], expert)


class MoECausalLM(LlamaForCausalLM):
    """A Llama-style decoder whose MLP is a ``SparseMoE`` on ``sparse_layers`` and dense elsewhere.

    ``make_attn`` gives a layer's attention (default: Llama's, with cfg.qk_norm); ``expert_shard`` says
    which experts this rank holds in every MoE layer (default: all)."""

    supports_parallel = False  # TP/PP/EP not wired in yet: the engine refuses them for these models
    checkpoint_slots = moe_checkpoint_slots

    def __init__(self, cfg: ArchConfig, max_positions: int, moe: MoEConfig, sparse_layers: set[int],
                 expert_shard: ExpertShard | None = None,
                 make_attn: Callable[[int], nn.Module] | None = None) -> None:
        if expert_shard is not None and expert_shard.num_experts != moe.routing.num_experts:
            raise ValueError(f"the expert shard covers {expert_shard.num_experts} experts, the model has "
                             f"{moe.routing.num_experts}")

        def layer(i: int) -> nn.Module:
            mlp = SparseMoE(cfg, moe, expert_shard) if i in sparse_layers else MLP(cfg)
            return DecoderLayer(cfg, make_attn(i) if make_attn else None, mlp)

        super().__init__(cfg, max_positions, make_layer=layer)
        self.moe = moe
        self.sparse_layers = sorted(sparse_layers)
