"""A member's side of an elastic resize: its experts re-placed for the group's new size, in the same process.

When the group re-forms at N members (the coordinator's ``reform``), member r keeps its rank and holds
``ExpertPlan(r, N).shard(E)`` from then on. Each MoE layer's stacks are rebuilt for that shard: the experts it
held before and still holds keep their weights (copied, never read again), and only the experts newly
assigned to it are read from the checkpoint (safetensors reads the named tensors only); the experts it lost
are dropped with the old stacks. Tensor-parallel experts (no ``--enable-expert-parallel``) change every
expert's slice with N, so they are all read again. Attention, norms, embeddings and the KV cache are per
rank and untouched: requests running on the member keep their KV blocks across the resize.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lbd.engine.dp.expert_parallel import ExpertDispatcher
from lbd.engine.loader import iter_checkpoint
from lbd.engine.models.moe import FusedExperts, checkpoint_expert


@dataclass(frozen=True, slots=True)
class Replaced:
    """What a re-placement did, per MoE layer counts summed over layers."""

    size: int  # the group's new size
    start: int  # the global experts now held: [start, stop)
    stop: int
    kept: int  # expert-layers whose weights stayed in memory
    loaded: int  # expert-layers read from the checkpoint
    seconds: float

    def describe(self) -> str:
        return (f"experts {self.start}..{self.stop - 1} for {self.size} members: kept {self.kept} and read "
                f"{self.loaded} expert-layers from the checkpoint in {self.seconds:.2f} s")


def replace_experts(model: nn.Module, dispatcher: ExpertDispatcher, size: int,
                    folder: str | Path) -> Replaced:
    """Re-place ``model``'s routed experts for a group of ``size`` members (this member's rank unchanged) and
    point ``dispatcher`` at the new placement."""
    t0 = time.monotonic()
    plan = dataclasses.replace(dispatcher.plan, size=size)
    shard = plan.shard(dispatcher.shard.num_experts)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, FusedExperts)}
    need = {name: set(m.reshard(shard)) for name, m in layers.items()}
    loaded = sum(len(v) for v in need.values())
    if loaded:
        _load(model, need, folder)
    dispatcher.place(plan, shard)
    return Replaced(size, shard.start, shard.stop, len(layers) * shard.num_local - loaded, loaded,
                    time.monotonic() - t0)


def _load(model: nn.Module, need: dict[str, set[int]], folder: str | Path) -> None:
    """Copy the checkpoint's tensors of the ``need``ed experts (module name -> global experts) into ``model``
    (its ``checkpoint_slots`` cut them for the new shard; a fused 3-D tensor fills every local expert)."""
    params = dict(model.named_parameters())
    slots_of = model.checkpoint_slots  # type: ignore[attr-defined]  # MoE models define it
    with torch.no_grad():
        for name, handle in iter_checkpoint(Path(folder)):
            found = checkpoint_expert(name)
            if found is None or not need.get(found[0]):
                continue
            module, expert = found
            if expert is not None and expert not in need[module]:
                continue  # kept, or another member's
            tensor = handle.get_tensor(name)  # type: ignore[attr-defined]
            for slot in slots_of(name):
                dst, src = slot.target(params[slot.param]), slot.source(tensor)
                if tuple(dst.shape) != tuple(src.shape):
                    raise ValueError(f"{name}: checkpoint part {tuple(src.shape)} != ours {tuple(dst.shape)}")
                dst.copy_(src)
