"""Elastic MoE groups without processes: the coordinator's resize state machine (lbd.engine.dp.coordinator),
an experts layer re-sharded in place (FusedExperts.reshard), and a tiny Mixtral's experts re-placed for 4 then
2 members (lbd.engine.dp.elastic) equal to the model loaded at each size, the kept experts not read again.
The whole path, rank cores re-forming 2 -> 4 -> 2 under streams, is tests/supervisor/test_moe_group.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lbd.engine.dp.coordinator import Coordinator
from lbd.engine.dp.elastic import replace_experts
from lbd.engine.dp.expert_parallel import ExpertDispatcher, ExpertPlan
from lbd.engine.loader import load_weights
from lbd.engine.models import build_model
from lbd.engine.models.config import load_hf_config
from lbd.engine.models.moe import ExpertShard, FusedExperts
from lbd.wire.dp_messages import Join, Joined, Report, WaveStarted, decode_from_coordinator


def _sent(out: list[tuple[bytes, bytes]]) -> list[tuple[bytes, str, int]]:
    return [(ident, (m := decode_from_coordinator(data)).__struct_config__.tag, m.generation)
            for ident, data in out]


def _form(c: Coordinator, idents: list[bytes], generation: int) -> None:
    for rank, ident in enumerate(idents):
        c.on_message(ident, Join(rank=rank, pid=100 + rank, last_generation=generation - 1), 0.0)
    for rank, ident in enumerate(idents):
        c.on_message(ident, Joined(rank=rank, generation=generation), 0.0)
    assert (c.generation, c.state, c.size) == (generation, "ready", len(idents))


def test_coordinator_resize_reforms_without_aborting_the_retiring_generation() -> None:
    c = Coordinator(2)
    with pytest.raises(ValueError, match="resize a ready group"):
        c.resize(4)
    _form(c, [b"a", b"b"], 1)
    assert c.on_message(b"c", Join(rank=2, pid=102), 0.0) == []  # a new rank too early: dropped
    out = c.resize(4)
    assert _sent(out) == [(b"a", "reform", 1), (b"b", "reform", 1)] and c.state == "reforming"
    assert decode_from_coordinator(out[0][1]).size == 4
    with pytest.raises(ValueError):
        c.resize(2)  # one at a time
    # the members still run generation 1's last steps: their reports are not answered with an abort
    assert c.on_message(b"a", Report(rank=0, generation=1, ready=True), 0.0) == []
    # a member that formed generation 2 and started a wave before the others joined: started once ready
    for rank, ident in enumerate([b"a", b"b", b"c", b"d"]):
        c.on_message(ident, Join(rank=rank, pid=100 + rank, last_generation=1), 0.0)
    c.on_message(b"a", Joined(rank=0, generation=2), 0.0)
    assert c.on_message(b"a", WaveStarted(rank=0, generation=2, wave=0), 0.0) == []
    for rank, ident in enumerate([b"b", b"c"], start=1):
        c.on_message(ident, Joined(rank=rank, generation=2), 0.0)
    assert _sent(c.on_message(b"d", Joined(rank=3, generation=2), 0.0)) == [
        (ident, "wave_start", 2) for ident in (b"a", b"b", b"c", b"d")]
    assert c.status(0.0).size == 4 and c.resizes == 1
    # shrinking: every member is told, the group waits for the 2 that stay
    c.on_message(b"a", WaveStarted(rank=0, generation=2, wave=0), 0.0)
    assert [k for _, k, _ in _sent(c.resize(2))] == ["reform"] * 4
    assert c.on_message(b"d", Join(rank=3, pid=103, last_generation=2), 0.0) == []  # removed: dropped
    _form(c, [b"a", b"b"], 3)


def test_experts_resharded_keep_what_both_hold_and_name_what_to_load() -> None:
    layer = FusedExperts(8, 6, ExpertShard.even(4, 1, 2))  # experts 2, 3
    layer.w13.copy_(torch.arange(layer.w13.numel(), dtype=layer.w13.dtype).view_as(layer.w13))
    layer.w2.copy_(-torch.arange(layer.w2.numel(), dtype=layer.w2.dtype).view_as(layer.w2))
    kept13, kept2 = layer.w13[0].clone(), layer.w2[0].clone()  # expert 2
    assert layer.reshard(ExpertShard.even(4, 2, 4)) == []  # rank 2 of 4 holds expert 2 only: kept
    assert layer.w13.shape[0] == 1 and torch.equal(layer.w13[0], kept13) and torch.equal(layer.w2[0], kept2)
    assert layer.expert_map.tolist() == [-1, -1, 0, -1]
    assert layer.reshard(ExpertShard.even(4, 0, 2)) == [0, 1]  # back to 2 members as rank 0: all new
    assert layer.w13.shape[0] == 2 and layer.expert_map.tolist() == [0, 1, -1, -1]
    assert layer.reshard(ExpertShard.even(4, 0, 1)) == [2, 3] and layer.expert_map is None


def _loaded(path: Path, shard: ExpertShard) -> torch.nn.Module:
    model = build_model(load_hf_config(path), 256, expert_shard=shard)
    load_weights(model, path)
    return model


def test_experts_re_placed_for_a_new_size_equal_the_model_loaded_at_it(tiny_mixtral: Path) -> None:
    for rank, steps in ((0, ((4, (0, 1), 2, 0), (2, (0, 2), 2, 2))),  # keeps expert 0, then reads 1
                        (1, ((4, (1, 2), 0, 2), (2, (2, 4), 0, 4)))):  # 2, 3 -> 1 -> 2, 3: all read
        plan = ExpertPlan(rank=rank, size=2, expert_parallel=True, backend="alltoall")
        model = _loaded(tiny_mixtral, plan.shard(4))
        dispatcher = ExpertDispatcher(plan, plan.shard(4), torch.device("cpu"))
        for size, held, kept, loaded in steps:
            done = replace_experts(model, dispatcher, size, tiny_mixtral)  # counts over its 2 MoE layers
            assert ((done.start, done.stop), done.kept, done.loaded) == (held, kept, loaded), done
            assert dispatcher._owner.tolist() == [e * size // 4 for e in range(4)]  # expert -> member
            want = _loaded(tiny_mixtral, ExpertShard.even(4, rank, size)).state_dict()
            got = model.state_dict()
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

