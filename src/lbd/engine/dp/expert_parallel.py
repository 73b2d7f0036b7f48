"""Which experts a DP member holds, and how each MoE layer's tokens reach them and come back.

Two placements (``ExpertPlan.shard``):
* expert parallel (``--enable-expert-parallel``): member r of N owns a contiguous slice of the experts
  (``ExpertShard.even``: uneven counts allowed, the first E % N members hold one more);
* tensor-parallel experts (default): every member holds 1/N of every expert's intermediate dimension.

Two ways to move tokens (``--all2all-backend``), chosen per layer call by ``ExpertDispatcher``:
* ``allgather_reducescatter``: every member's tokens are gathered everywhere (rows padded to the largest
  member's count), each member runs its experts (or slices) on all of them, and a reduce-scatter sums the
  partial outputs back to the owners of the tokens. Two collectives a layer plus one count exchange a pass.
  The only choice for tensor-parallel experts.
* ``alltoall``: each token goes only to the members owning one of its top-k experts (once per member),
  and their partial sums come back: three all-to-alls a layer (counts, tokens, results). The default with
  expert parallelism: faster per layer at every batch size benchmarks/ep_dispatch.py covers
  (benchmarks/RESULTS.md, "Expert dispatch").

Routing weights and expert ids travel with the hidden states in one fp32 tensor (ids are exact in fp32; bf16
and fp16 hidden states round-trip through fp32 exactly). A rank with no tokens (a dummy pass) takes part with
zero rows, so the collectives of every member line up.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lbd.engine.dp.group import DPGroup, GroupLost
from lbd.engine.models.moe import ExpertShard, FusedExperts, SparseMoE

BACKENDS = ("allgather_reducescatter", "alltoall")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class ExpertPlan:
    rank: int
    size: int
    expert_parallel: bool
    backend: str = "allgather_reducescatter"

    @classmethod
    def from_args(cls, args: Any) -> ExpertPlan:
        """``--all2all-backend auto``: all-to-all with expert parallelism (the faster one there:
        benchmarks/RESULTS.md, "Expert dispatch"), all-gather + reduce-scatter for tensor-parallel experts."""
        backend = args.all2all_backend
        if backend == "auto":
            backend = "alltoall" if args.enable_expert_parallel else "allgather_reducescatter"
        return cls(args.rank, args.data_parallel_size, args.enable_expert_parallel, backend)

    def shard(self, num_experts: int) -> ExpertShard:
        if self.expert_parallel:
            return ExpertShard.even(num_experts, self.rank, self.size)
        return ExpertShard(num_experts, tp_rank=self.rank, tp_size=self.size)


def routed_experts(hf_config: Any) -> int:
    """The routed experts per MoE layer of a (``load_hf_config``) config."""
    for key in ("num_local_experts", "n_routed_experts", "num_experts"):
        value = getattr(hf_config, key, None)
        if value:
            return int(value)
    raise ValueError("the model config names no routed experts (num_local_experts / n_routed_experts)")


def _pack(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, D + 2k] fp32: hidden | weights | ids, zero-padded below x's rows."""
    t, d = x.shape
    k = ids.shape[1]
    out = torch.zeros(rows, d + 2 * k, dtype=torch.float32, device=x.device)
    out[:t, :d] = x
    out[:t, d:d + k] = weights
    out[:t, d + k:] = ids
    return out


def _unpack(p: torch.Tensor, d: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return (p[:, :d].to(dtype).contiguous(), p[:, d:d + k].contiguous(),
            p[:, d + k:].to(torch.int32).contiguous())


class ExpertDispatcher:
    """One per rank, shared by its MoE layers; ``group`` is set to each generation's DPGroup (None while
    the group is re-forming: a forward then raises GroupLost)."""

    def __init__(self, plan: ExpertPlan, shard: ExpertShard, device: torch.device) -> None:
        if plan.backend not in BACKENDS:
            raise ValueError(f"unknown --all2all-backend {plan.backend!r}: use one of {', '.join(BACKENDS)}")
        self.group: DPGroup | None = None
        self.passes = 0  # forward passes through the MoE layers (real or dummy)
        self.first_layer = 0
        self._tmax = 0
        self.device = device
        self.place(plan, shard)

    def place(self, plan: ExpertPlan, shard: ExpertShard) -> None:
        """Use ``plan`` (this member's rank in a group of ``plan.size``) and hold ``shard`` (at start, and
        after an elastic resize re-placed the experts: ``lbd.engine.dp.elastic``)."""
        self.plan, self.shard = plan, shard
        starts = [ExpertShard.even(shard.num_experts, r, plan.size).start for r in range(plan.size)]
        owner = torch.zeros(shard.num_experts, dtype=torch.long)
        for r, s in enumerate(starts):
            owner[s:] = r
        self._owner = owner.to(self.device)  # global expert -> member owning it (expert parallel)
        self.uses_all_to_all = plan.expert_parallel and plan.backend == "alltoall"

    def bind(self, layer: int) -> Callable[..., torch.Tensor]:
        def dispatch(experts: FusedExperts, x: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor) -> torch.Tensor:
            return self(experts, x, weights, ids, layer)
        return dispatch

    def __call__(self, experts: FusedExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 layer: int) -> torch.Tensor:
        group = self.group
        if group is None:
            raise GroupLost("the DP group is not formed")
        if layer == self.first_layer:
            self.passes += 1
            if not self.uses_all_to_all:  # every layer of a pass has the same token count: exchange it once
                counts = group.all_gather(torch.tensor([x.shape[0]], dtype=torch.long, device=x.device))
                self._tmax = int(max(int(c) for c in counts))
        if self.uses_all_to_all:
            return self._dispatch_all_to_all(group, experts, x, weights, ids)
        return self._gather_scatter(group, experts, x, weights, ids)

    def _gather_scatter(self, group: DPGroup, experts: FusedExperts, x: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor) -> torch.Tensor:
        tmax, (t, d), k = self._tmax, x.shape, ids.shape[1]
        if tmax == 0:  # every member is in a dummy pass
            return x.new_zeros(0, d)
        gathered = torch.empty(group.size * tmax, d + 2 * k, dtype=torch.float32, device=x.device)
        group.all_gather_into(gathered, _pack(x, weights, ids, tmax))
        partial = experts(*_unpack(gathered, d, k, x.dtype)).float()
        out = torch.empty(tmax, d, dtype=torch.float32, device=x.device)
        group.reduce_scatter(out, partial)
        return out[:t].to(x.dtype)

    def _dispatch_all_to_all(self, group: DPGroup, experts: FusedExperts, x: torch.Tensor,
                             weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        n, (t, d), k, dev = group.size, x.shape, ids.shape[1], x.device
        to = torch.zeros(t, n, dtype=torch.bool, device=dev)
        if t:
            to.scatter_(1, self._owner[ids.long()], True)
        rows = [to[:, r].nonzero().squeeze(1) for r in range(n)]
        send_idx = torch.cat(rows)
        send = [int(r.numel()) for r in rows]
        recv_t = torch.empty(n, dtype=torch.long, device=dev)
        group.all_to_all(recv_t, torch.tensor(send, dtype=torch.long, device=dev), [1] * n, [1] * n)
        recv = [int(c) for c in recv_t.tolist()]
        payload = _pack(x[send_idx], weights[send_idx], ids[send_idx], len(send_idx))
        got = torch.empty(sum(recv), d + 2 * k, dtype=torch.float32, device=dev)
        group.all_to_all(got, payload, recv, send)
        partial = experts(*_unpack(got, d, k, x.dtype)).float()
        back = torch.empty(len(send_idx), d, dtype=torch.float32, device=dev)
        group.all_to_all(back, partial.contiguous(), send, recv)
        out = torch.zeros(t, d, dtype=torch.float32, device=dev)
        out.index_add_(0, send_idx, back)
        return out.to(x.dtype)


def moe_layers(model: nn.Module) -> list[tuple[int, SparseMoE]]:
    """(layer index, block) of every sparse MoE block, in forward order."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, SparseMoE):
            m = _LAYER.search(name + ".")
            found.append((int(m.group(1)) if m else len(found), module))
    return sorted(found, key=lambda p: p[0])


def attach(model: nn.Module, dispatcher: ExpertDispatcher) -> list[SparseMoE]:
    """Route every MoE block of ``model`` through ``dispatcher``; returns the blocks in forward order."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no MoE layers: a DP group is for MoE models")
    dispatcher.first_layer = layers[0][0]
    for index, block in layers:
        block.dispatch = dispatcher.bind(index)
    return [block for _, block in layers]


def dummy_pass(blocks: list[SparseMoE], hidden_size: int, device: torch.device, dtype: torch.dtype) -> None:
    """The MoE blocks with zero tokens: this rank's part of every layer's collectives when it has nothing
    scheduled (attention is per rank, so nothing else needs to run)."""
    x = torch.empty(0, hidden_size, dtype=dtype, device=device)
    with torch.inference_mode():
        for block in blocks:
            block(x)
