"""Elastic MoE groups (lbd.engine.dp.elastic and the ``reform`` path of lbd.engine.dp.rank/coordinator): a
tiny Mixtral group of 2 rank cores grows to 4 and shrinks back to 2 through the coordinator's POST /resize,
with a long greedy request running on rank 0 across each resize. Its tokens equal one rank serving alone
(test_parity's near-tie rule), the survivors keep their processes, the new ranks serve, and a request on a
removed rank ends with a retryable 503. Cost on the 2 shared cores: about 25 CPU-s (five processes). Without
processes: the coordinator's resize state machine, and an experts layer re-sharded in place.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import torch

from lbd.engine.core.engine_core import EngineCore
from lbd.engine.dp.coordinator import Coordinator
from lbd.engine.models.config import load_hf_config
from lbd.engine.models.moe import ExpertShard, FusedExperts
from lbd.wire.dp_messages import Join, Joined, Report, WaveStarted, decode_from_coordinator
from support import stop
from support.dp import CoreConn, Group
from support.parity import assert_all_close, engine_args, greedy, random_prompts, run_engine

FLAGS = ("--enable-expert-parallel", "--dp-idle-check-steps", "4")


def _resize(group: Group, size: int) -> dict:
    r = httpx.post(group.http + "/resize", json={"size": size}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_group_grows_2_to_4_and_shrinks_back_keeping_survivors_and_their_requests(tiny_mixtral: Path,
                                                                                 tmp_path: Path) -> None:
    path = tiny_mixtral
    prompt = random_prompts(1, (8, 16), load_hf_config(path).vocab_size, seed=61)[0]
    want = run_engine(EngineCore.from_args(engine_args(path), str(path)), [prompt], [greedy(200)])
    group = Group(2, tmp_path)
    with group.coordinator():
        procs = [group.start_core(path, r, *FLAGS) for r in range(2)]
        conns = [CoreConn(a) for _, a in procs]
        try:
            for c in conns:
                c.hello()
                c.wait_dp(lambda d: d["state"] == "ready")
            # not ready to take a size the experts do not fit: refused, nothing changes
            assert httpx.post(group.http + "/resize", json={"size": 0}).status_code == 409
            assert httpx.post(group.http + "/resize", json={"size": "4"}).status_code == 400
            # the new ranks start (size 4) while the old group serves; their joins wait for the resize
            group.size = 4
            procs += [group.start_core(path, r, *FLAGS) for r in (2, 3)]
            conns += [CoreConn(a) for _, a in procs[2:]]
            for c in conns[2:]:
                c.hello()
            conns[0].add("grow", prompt, greedy(200))
            conns[0].wait_tokens("grow", 3)
            t0 = time.monotonic()
            assert _resize(group, 4) == {"generation": 2, "state": "reforming", "size": 4}
            for c in conns:
                c.wait_dp(lambda d: d["state"] == "ready" and d["generation"] == 2, timeout=120)
            grown = time.monotonic() - t0
            conns[0].wait_done(["grow"])
            assert not conns[0].errors
            assert_all_close([conns[0].runs["grow"]], want)
            conns[3].add("new", prompt, greedy(12))  # a new rank serves (its experts 3 of 4, the rest remote)
            conns[3].wait_done(["new"])
            assert_all_close([conns[3].runs["new"]], [_prefix(want[0], 12)])
            # shrink: rank 3's stream is cut with a retryable 503; rank 0's goes on in generation 3
            conns[3].add("cut", prompt, greedy(200))
            conns[0].add("shrink", prompt, greedy(200))
            conns[3].wait_tokens("cut", 2)
            t0 = time.monotonic()
            assert _resize(group, 2)["generation"] == 3
            for c in conns[:2]:
                c.wait_dp(lambda d: d["state"] == "ready" and d["generation"] == 3, timeout=120)
            shrunk = time.monotonic() - t0
            conns[3].wait_done(["cut"])
            status, message = conns[3].errors["cut"]
            assert status == 503 and "left the data-parallel group" in message and "retry" in message
            conns[0].wait_done(["shrink"])
            assert "shrink" not in conns[0].errors
            assert_all_close([conns[0].runs["shrink"]], want)
            status = httpx.get(group.http + "/status").json()
            assert (status["size"], status["generation"], status["state"]) == (2, 3, "ready")
            assert [m["pid"] for m in status["members"]] == [procs[0][0].pid, procs[1][0].pid]
            assert [p.poll() for p, _ in procs] == [None] * 4  # removed ranks idle until told to stop
            print(f"2 -> 4 ranks serving again in {grown:.1f} s, 4 -> 2 in {shrunk:.1f} s")
        finally:
            for c in conns:
                c.close()
            for p, _ in procs:
                stop(p)


def _prefix(run: object, n: int) -> object:
    from support.parity import Run

    assert isinstance(run, Run)
    return Run(run.tokens[:n], run.top[:n], run.chosen[:n])


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
