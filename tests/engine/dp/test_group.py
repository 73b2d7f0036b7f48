"""MoE DP groups (lbd.engine.dp) with real processes: a coordinator and two rank cores (gloo on the CPU) per
test, driven over the engine's own ZMQ protocol. Greedy tokens of tiny Mixtral, Qwen3-MoE and DeepSeek-V2
served by the group equal one rank serving alone (test_parity's near-tie rule), with expert parallelism
(both token movers) and with tensor-parallel experts; requests land on either rank, first with the other
rank idle (it runs zero-token dummy passes), then on both. Waves end, idle ranks block (CPU measured), a
restarted coordinator gets a new generation from the same rank processes, and the coordinator's state
machine is checked without processes; a rank whose group has not formed answers 503 with X-lbd-dp-state
over HTTP.

Cost on the shared 2-core machine: about 10 CPU-s per group test (three processes import torch and load a
model), 75 CPU-s for the file; two of the tensor-parallel-expert cases are marked slow (about 50 CPU-s left).
"""

from __future__ import annotations

import random
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from lbd.engine.core.engine_core import EngineCore
from lbd.engine.dp.coordinator import Coordinator
from lbd.engine.dp.wave import Wave
from lbd.wire.dp_messages import Join, Joined, Lost, Report, WaveEnded, WaveStarted, decode_from_coordinator
from support import free_port, spawn, stop, tree_usage, wait_http
from support.dp import CoreConn, Group
from support.parity import assert_all_close, engine_args, greedy, random_prompts, run_engine


def _prompts(path: Path, n: int, seed: int) -> list[list[int]]:
    from lbd.engine.models.config import load_hf_config

    return random_prompts(n, (1, 40), load_hf_config(path).vocab_size, seed=seed)


@pytest.mark.parametrize(("kind", "flags"), [
    ("mixtral", ["--enable-expert-parallel"]),
    ("qwen3_moe", ["--enable-expert-parallel", "--all2all-backend", "allgather_reducescatter"]),
    ("deepseek_v2", ["--enable-expert-parallel"]),
    ("mixtral", []),
    pytest.param("qwen3_moe", [], marks=pytest.mark.slow),
    pytest.param("deepseek_v2_grouped", [], marks=pytest.mark.slow),
], ids=["mixtral-ep", "qwen3_moe-ep-allgather", "deepseek_v2-ep", "mixtral-tp", "qwen3_moe-tp",
        "deepseek_v2_grouped-tp"])
def test_group_tokens_equal_one_rank(kind: str, flags: list[str], request: pytest.FixtureRequest,
                                     tmp_path: Path) -> None:
    path = request.getfixturevalue(f"tiny_{kind}")
    rng = random.Random(3)
    alone, first, second = _prompts(path, 3, 31), _prompts(path, 3, 32), _prompts(path, 3, 33)
    lens = [rng.randint(3, 10) for _ in range(9)]
    want = run_engine(EngineCore.from_args(engine_args(path), str(path)), alone + first + second,
                      [greedy(n) for n in lens])
    group = Group(2, tmp_path)
    measure_idle = kind == "mixtral" and flags
    with group.coordinator():
        procs = [group.start_core(path, r, "--dp-idle-check-steps", "8", *flags) for r in range(2)]
        conns = [CoreConn(address) for _, address in procs]
        try:
            for c in conns:
                c.hello()
                c.wait_dp(lambda d: d["state"] == "ready")
            # rank 1 alone: rank 0 has nothing and must run dummy passes for the wave to progress
            for i, prompt in enumerate(alone):
                conns[1].add(f"a{i}", prompt, greedy(lens[i]))
            conns[1].wait_done([f"a{i}" for i in range(3)])
            idle = conns[0].wait_dp(lambda d: not d["wave_active"] and d["waves"] >= 1)
            assert idle["dummy_steps"] >= idle["steps"] - 1 > 0  # every pass of rank 0 was a dummy one
            # both ranks busy at once
            for i, prompt in enumerate(first):
                conns[0].add(f"b{i}", prompt, greedy(lens[3 + i]))
            for i, prompt in enumerate(second):
                conns[1].add(f"c{i}", prompt, greedy(lens[6 + i]))
            conns[0].wait_done([f"b{i}" for i in range(3)])
            conns[1].wait_done([f"c{i}" for i in range(3)])
            assert not conns[0].errors and not conns[1].errors
            got = ([conns[1].runs[f"a{i}"] for i in range(3)] + [conns[0].runs[f"b{i}"] for i in range(3)]
                   + [conns[1].runs[f"c{i}"] for i in range(3)])
            assert_all_close(got, want)
            _wait_paused(group)  # the wave ends by itself (the idle all-reduce every 8 steps)
            if measure_idle:
                status = httpx.get(group.http + "/status").json()
                assert status["state"] == "ready" and not status["wave"]["active"]
                assert status["wave"]["count"] >= 2 and all(m["joined"] for m in status["members"])
                pids = [p.pid for p, _ in procs]
                before, t0 = tree_usage(*pids)[0], time.monotonic()
                time.sleep(3)  # 0.3 CPU-s allowed: far above the clock ticks' resolution
                used = (tree_usage(*pids)[0] - before) / (time.monotonic() - t0)
                assert used < 0.05 * 2, f"two idle ranks used {used:.1%} of a core"
                # a restarted coordinator: the ranks leave the group it does not know and form generation 2
                group.coord.kill()
                group.coord.wait(10)
                group.start_coordinator()
                for c in conns:
                    c.wait_dp(lambda d: d["state"] == "ready" and d["generation"] == 2, timeout=60)
                assert [p.poll() for p, _ in procs] == [None, None]
                conns[1].add("d0", alone[0], greedy(lens[0]))
                conns[1].wait_done(["d0"])
                assert_all_close([conns[1].runs["d0"]], want[:1])
        finally:
            for c in conns:
                c.close()
            for p, _ in procs:
                stop(p)


def test_survivor_rejoins_next_generation_with_the_same_process(tiny_mixtral: Path, tmp_path: Path) -> None:
    """SIGKILL of rank 1 while rank 0 works: rank 0's requests fail with 503, it re-forms generation 2 with
    a restarted rank 1 in the same process (weights kept) and serves the same tokens; then a SIGSTOPped rank
    1 reported by the supervisor's POST aborts generation 2 while rank 0 is idle."""
    path = tiny_mixtral
    prompt = _prompts(path, 1, 41)[0]
    want = run_engine(EngineCore.from_args(engine_args(path), str(path)), [prompt], [greedy(6)])
    group = Group(2, tmp_path)
    with group.coordinator():
        procs = [group.start_core(path, r, "--enable-expert-parallel") for r in range(2)]
        conns = [CoreConn(a) for _, a in procs]
        try:
            for c in conns:
                c.hello()
                c.wait_dp(lambda d: d["state"] == "ready")
            core0 = httpx.get(group.http + "/status").json()["members"][0]["pid"]
            assert core0 == procs[0][0].pid
            conns[0].add("long", prompt, greedy(200))
            conns[0].wait_tokens("long", 2)
            procs[1][0].kill()
            conns[0].wait_done(["long"], timeout=60)
            status, message = conns[0].errors["long"]
            assert status == 503 and "retry" in message
            lost = conns[0].wait_dp(lambda d: d["state"] == "reforming", timeout=30)
            assert lost["generation"] == 1
            conns[1].close()
            conns[0].add("refused", prompt, greedy(2))  # not ready: refused at once
            conns[0].wait_done(["refused"], timeout=30)
            assert conns[0].errors["refused"][0] == 503
            procs[1] = group.start_core(path, 1, "--enable-expert-parallel")
            conns[1] = CoreConn(procs[1][1])
            conns[1].hello()
            conns[0].wait_dp(lambda d: d["state"] == "ready" and d["generation"] == 2, timeout=120)
            status = httpx.get(group.http + "/status").json()
            assert (status["generation"], status["state"], status["generation_aborts"]) == (2, "ready", 1)
            assert status["members"][0]["pid"] == core0 and procs[0][0].poll() is None
            conns[0].add("again", prompt, greedy(6))
            conns[0].wait_done(["again"])
            assert_all_close([conns[0].runs["again"]], want)
            _wait_paused(group)
            # a hung member, reported by the supervisor (which SIGKILLs it next): the idle survivor is told
            procs[1][0].send_signal(signal.SIGSTOP)
            r = httpx.post(group.http + "/members/1/failed", json={"reason": "probe timeout"})
            assert r.status_code == 200 and r.json() == {"generation": 3, "state": "reforming"}
            assert httpx.post(group.http + "/members/1/failed").json()["generation"] == 3  # idempotent
            assert httpx.post(group.http + "/members/7/failed").status_code == 404
            conns[0].wait_dp(lambda d: d["state"] == "reforming" and d["generation"] == 2, timeout=30)
            procs[1][0].kill()
        finally:
            for c in conns:
                c.close()
            for p, _ in procs:
                stop(p)


def _wait_paused(group: Group, timeout: float = 30.0) -> None:
    """Until the coordinator and every member's last report say no wave runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = httpx.get(group.http + "/status").json()
        if not status["wave"]["active"] and not any(m["wave_active"] for m in status["members"]):
            return
        time.sleep(0.1)
    raise TimeoutError(f"the wave did not end within {timeout}s")


# ---- the coordinator's state machine and the wave, without processes -------------------------------------


def _kinds(out: list[tuple[bytes, bytes]]) -> list[tuple[bytes, str, int]]:
    """(to whom, kind, generation) of each message the coordinator would send."""
    sent = [(ident, decode_from_coordinator(data)) for ident, data in out]
    return [(ident, msg.__struct_config__.tag, msg.generation) for ident, msg in sent]


def test_coordinator_forms_aborts_and_re_forms() -> None:
    c = Coordinator(2)
    join = Join(rank=0, pid=10)
    assert c.on_message(b"a", join, 0.0) == [] and c.state == "forming"
    assert c.reason == "waiting for ranks [1] to join generation 1"
    out = c.on_message(b"b", Join(rank=1, pid=11), 0.0)
    assert _kinds(out) == [(b"a", "form", 1), (b"b", "form", 1)]
    assert c.on_message(b"a", join, 0.0) == []  # a join re-sent before the form arrived changes nothing
    for rank in (0, 1):
        c.on_message(b"ab"[rank:rank + 1], Joined(rank=rank, generation=1), 0.0)
    assert c.state == "ready" and c.reason is None
    # waves: one start is published to every member once; a stale one is ignored
    start = WaveStarted(rank=1, generation=1, wave=0)
    assert [k for _, k, _ in _kinds(c.on_message(b"b", start, 0.0))] == ["wave_start"] * 2
    assert c.on_message(b"a", WaveStarted(rank=0, generation=1, wave=0), 0.0) == []
    c.on_message(b"a", WaveEnded(rank=0, generation=1, wave=0), 0.0)
    assert not c.wave_active and c.on_message(b"b", start, 0.0) == []
    # a failed member aborts the generation once (told to every member: a wrongly reported one leaves too);
    # the survivors re-join generation 2
    assert _kinds(c.member_failed(1, "killed")) == [(b"a", "abort", 1), (b"b", "abort", 1)]
    assert (c.generation, c.state, c.member_failed(1, "again")) == (2, "reforming", [])
    assert c.on_message(b"a", Joined(rank=0, generation=1), 0.0) == []  # late: ignored
    c.on_message(b"a", join, 0.0)
    out = c.on_message(b"c", Join(rank=1, pid=12), 0.0)
    assert _kinds(out) == [(b"a", "form", 2), (b"c", "form", 2)]
    for rank, ident in ((0, b"a"), (1, b"c")):
        c.on_message(ident, Joined(rank=rank, generation=2), 0.0)
    assert c.state == "ready"
    # a member of the group that joins again (it restarted: a new pid) aborts generation 2 by itself
    out = c.on_message(b"d", Join(rank=1, pid=13), 0.0)
    assert _kinds(out)[:2] == [(b"a", "abort", 2), (b"c", "abort", 2)] and c.generation == 3
    # a rank whose collective failed reports it
    c.on_message(b"a", join, 0.0)
    c.on_message(b"d", Joined(rank=1, generation=3), 0.0)
    assert c.on_message(b"a", Lost(rank=0, generation=3, reason="x"), 0.0)
    assert c.generation == 4 and c.aborts == 3
    c.on_message(b"a", Report(rank=0, waiting=2, running=1), 1.0)
    member = c.status(1.5).members[0]
    assert (member.waiting, member.running, member.last_report_age_s) == (2, 1, 0.5)
    assert c.on_message(b"z", Report(rank=7), 1.0) == []  # not a rank of this group: dropped


def test_a_restarted_coordinator_sends_ranks_out_of_its_predecessors_group() -> None:
    c = Coordinator(2)
    report = Report(rank=1, generation=5, ready=True)
    assert _kinds(c.on_message(b"b", report, 0.0)) == [(b"b", "abort", 5)]
    assert c.on_message(b"b", Report(rank=1, generation=5), 0.0) == []  # once it left, nothing more
    c.on_message(b"a", Join(rank=0, pid=1, last_generation=5), 0.0)
    out = c.on_message(b"b", Join(rank=1, pid=2, last_generation=5), 0.0)
    assert _kinds(out) == [(b"a", "form", 6), (b"b", "form", 6)]  # numbered after the ranks' last one


def test_wave_numbers_and_stale_starts() -> None:
    w = Wave(check_steps=2)
    assert w.start() and not w.start(0)  # started here; the coordinator's echo is ignored
    assert [w.stepped(dummy=d) for d in (False, True)] == [False, True]
    assert (w.end(), w.id, w.dummy_steps) == (0, 1, 1)
    assert not w.start(0) and w.start(1)  # a stale start; then the next wave
    w.reset()
    assert (w.active, w.id) == (False, 0)


def test_rank_answers_503_while_its_group_forms(tiny_mixtral: Path, tmp_path: Path) -> None:
    """A rank whose peer never comes: alive (its /status answers) but not ready: /health and completions get
    503 with X-lbd-dp-state: forming and the reason; the coordinator says who is missing."""
    group = Group(2, tmp_path)
    with group.coordinator():
        port = free_port()
        proc = spawn([sys.executable, "-m", "lbd.engine", "--model", str(tiny_mixtral), "--host", "127.0.0.1",
                      "--port", str(port), "--kv-cache-memory-bytes", "16MiB", *group.flags(0)],
                     log=tmp_path / "rank0.log")
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(url + "/health", timeout=120, proc=proc, ok=(503,))
            health = httpx.get(url + "/health")
            assert health.headers["X-lbd-dp-state"] == "forming"
            assert "data-parallel group is forming" in health.json()["error"]["message"]
            r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["X-lbd-dp-state"] == "forming"
            status = httpx.get(url + "/status").json()
            assert (status["rank"], status["ready"], status["dp"]["state"]) == (0, False, "forming")
            coord = httpx.get(group.http + "/status").json()
            assert coord["state"] == "forming"
            assert coord["reason"] == "waiting for ranks [1] to join generation 1"
            assert [m["pid"] for m in coord["members"]] == [status["core_pid"], None]
        finally:
            stop(proc)
