"""`lbd supervise` running a tiny Mixtral as one MoE group of 2 DP ranks (gloo on the CPU, expert parallel):
the coordinator beside rank 0, pinned requests while the other rank idles, idle CPU, healing (a SIGKILLed or
SIGSTOPped member is replaced while the survivor keeps its process, behind a real `lbd route`), resizing
2 -> 4 -> 2 under streams, and a group across two supervisors.

One group (a module fixture) serves every single-node test in order, each leaving it ready: one group start
instead of four.

Cost (2 shared cores): the group start ~11 s, the first test ~6 s; slow: the coordinator restart ~5 s, the
healing test ~30 s, the resize ~40 s, two supervisors (a group of their own) ~20-30 s.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lbd.supervisor.group import with_size
from support import (
    RouterServer,
    free_port,
    free_port_run,
    metric_value,
    spawn,
    stop,
    tree_usage,
    wait_http,
)
from support.node import SupervisorNode

PROMPT = "The capital of France is"
ADMIN = "moe-scale-token"
TOKENS = 120  # per resize stream: a few seconds on the CPU, across the re-form


def _complete(url: str, model: str, rank: int | None = None, max_tokens: int = 8,
              **extra: Any) -> httpx.Response:
    headers = {"X-data-parallel-rank": str(rank)} if rank is not None else {}
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)


def _group(node: SupervisorNode) -> dict[str, Any]:
    (group,) = node.status()["groups"]
    return group


def _core_pids(node: SupervisorNode) -> dict[int, int | None]:
    return {m["rank"]: m["core_pid"] for m in _group(node)["members"]}


@pytest.fixture(scope="module")
def node(tiny_mixtral: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorNode]:
    """One group of 2 ranks shared by the single-node tests below, in order (each leaves it ready): one group
    start instead of three. No restart backoff, so a failed member is replaced at once."""
    port = free_port_run(4)  # the ranks' ports: 2, and 4 while it is resized
    sup = SupervisorNode(tiny_mixtral, 2, "--enable-expert-parallel", "--restart-backoff-initial-s", "0",
                         "--max-num-seqs", "4", "--port", str(port), "--admin-token", ADMIN,
                         "--shutdown-timeout", "1", "--scale-down-drain-timeout-s", "0",
                         log=tmp_path_factory.mktemp("moe-group") / "node.log")
    sup.base_port = port  # (the last --port wins) rank_url(r) is port + r
    try:
        sup.wait_ready(300)
        yield sup
    finally:
        sup.close()
    leftovers = sup.marked_processes()
    for p in leftovers:
        p.send_signal(signal.SIGKILL)
    assert not leftovers


def test_moe_group_serves_pinned_requests_and_idles(node: SupervisorNode, tiny_mixtral: Path) -> None:
    group = _group(node)
    assert group["ready"] and group["state"] == "ready" and group["expert_parallel"]
    assert group["generation"] >= 1 and group["size"] == 2 and group["coordinator"]["alive"]
    assert [m["joined"] for m in group["members"]] == [True, True]
    readyz = node.get("/readyz")
    assert readyz.status_code == 200 and "MoE group" in readyz.text and "ready" in readyz.text
    assert all(r["routable"] for r in node.status()["ranks"])
    model = str(tiny_mixtral)
    # rank 1 pinned while rank 0 has nothing to do: rank 0 runs dummy passes so the experts' collectives
    # meet; both ranks give the same greedy tokens
    one = _complete(node.rank_url(1), model, rank=1)
    assert one.status_code == 200, one.text
    zero = _complete(node.rank_url(0), model, rank=0)
    assert zero.status_code == 200, zero.text
    assert one.json()["choices"][0]["text"] == zero.json()["choices"][0]["text"]
    # after the work, the wave ends and the ranks stop stepping: idle CPU under 5% of a core each
    node.wait_for(lambda: not (_group(node)["wave"] or {}).get("active"), 30, "the wave to end")
    time.sleep(0.5)
    pids = [r["pid"] for r in node.status()["ranks"]]
    before = [tree_usage(pid)[0] for pid in pids]
    time.sleep(5.0)
    used = [tree_usage(pid)[0] - b for pid, b in zip(pids, before, strict=True)]
    print(f"idle CPU over 5 s per rank: {[round(u, 3) for u in used]} s")
    assert all(u < 0.05 * 5.0 for u in used), used
    metrics = node.get("/metrics").text
    assert metric_value(metrics, "lbd_supervisor_group_ready") == 1.0
    assert metric_value(metrics, "lbd_supervisor_group_member_joined", rank="1") == 1.0
    assert metric_value(metrics, "lbd_supervisor_group_generation") >= 1


@pytest.mark.slow
def test_a_dead_coordinator_is_restarted_and_the_group_serves_again(node: SupervisorNode,
                                                                    tiny_mixtral: Path) -> None:
    node.wait_ready(60)
    pids = [r["pid"] for r in node.status()["ranks"]]
    group = _group(node)
    os.kill(group["coordinator"]["pid"], signal.SIGKILL)
    node.wait_for(lambda: _group(node)["coordinator"]["restarts"] == 1
                  and _group(node)["coordinator"]["pid"] not in (None, group["coordinator"]["pid"])
                  and node.get("/readyz").status_code == 200, 120, "the group around a new coordinator")
    assert [r["pid"] for r in node.status()["ranks"]] == pids  # the ranks were not restarted
    body = {"model": str(tiny_mixtral), "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    r = httpx.post(node.rank_url(1) + "/v1/completions", json=body, timeout=30,
                   headers={"X-data-parallel-rank": "1"})
    assert r.status_code == 200, r.text


class Load:
    """Concurrent completions through the router until stopped: each request ends one way or another."""

    def __init__(self, url: str, model: str, clients: int = 4) -> None:
        self.url, self.model = url, model
        self.outcomes: list[tuple[str, str]] = []  # (kind, detail): ok | stream_ok | stream_error | http_<n>
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i % 2 == 1,), daemon=True)
                        for i in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self, streaming: bool) -> None:
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        with httpx.Client(timeout=httpx.Timeout(90.0)) as client:
            while not self.stop.is_set():
                try:
                    if streaming:
                        self.outcomes.append(self._stream(client, body))
                    else:
                        r = client.post(self.url + "/v1/completions", json=body)
                        self.outcomes.append(("ok" if r.status_code == 200 else f"http_{r.status_code}",
                                              r.text[:200]))
                except httpx.HTTPError as e:  # a hang would be a ReadTimeout: counted, and it fails the test
                    self.outcomes.append(("exception", repr(e)))
                if self.outcomes[-1][0] not in ("ok", "stream_ok"):
                    time.sleep(0.2)  # refused while the group re-forms: as a client would, wait a little

    def _stream(self, client: httpx.Client, body: dict[str, Any]) -> tuple[str, str]:
        with client.stream("POST", self.url + "/v1/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                r.read()
                return f"http_{r.status_code}", r.text[:200]
            lines = [line for line in r.iter_lines() if line]
        error = any('"error"' in line for line in lines)
        done = bool(lines) and lines[-1] == "data: [DONE]"
        return ("stream_error" if error or not done else "stream_ok"), (lines[-1] if lines else "")[:200]

    def finish(self) -> list[tuple[str, str]]:
        self.stop.set()
        for t in self.threads:
            t.join(120)
        assert not any(t.is_alive() for t in self.threads), "a request hung"
        return self.outcomes


def _heal(node: SupervisorNode, victim: int, sig: signal.Signals, router_url: str, model: str
          ) -> dict[str, Any]:
    """Fail ``victim`` with ``sig`` under load; returns what happened."""
    survivor = 1 - victim
    status = node.status()
    pids = {r["rank"]: r["pid"] for r in status["ranks"]}
    cold = {r["rank"]: r["uptime_s"] - r["ready_for_s"] for r in status["ranks"]}
    cores = _core_pids(node)
    generation = _group(node)["generation"]
    load = Load(router_url, model)
    time.sleep(1.5)  # the group is busy
    t0 = time.monotonic()
    if sig is signal.SIGSTOP:  # the whole rank hangs: its launcher, front end and core
        for p in node.rank_tree(victim):
            p.send_signal(signal.SIGSTOP)
    else:
        node.signal_rank(victim, sig)
    detected = node.wait_for(lambda: node.rank(victim)["state"] != "ready", 60, f"rank {victim} failing")
    node.wait_for(lambda: _group(node)["generation"] > generation and node.get("/readyz").status_code == 200,
                  300, "the group to serve again")
    healed = time.monotonic() - t0
    time.sleep(1.0)  # a few requests on the healed group
    outcomes = load.finish()
    after = node.status()
    group = _group(node)
    assert {r["rank"]: r["pid"] for r in after["ranks"]}[survivor] == pids[survivor]  # survivor kept
    assert _core_pids(node)[survivor] == cores[survivor]
    assert {r["rank"]: r["pid"] for r in after["ranks"]}[victim] != pids[victim]  # only the victim restarted
    assert group["last_recovery"]["rank"] == victim and group["ready"]
    # every request that reached a member either succeeded (those cut before their first byte were retried
    # by the router) or, streaming already, ended with an error event; none hung or was cut silently. One
    # arriving while no member could take it was refused at once (a 503 from the router, nothing started).
    refused = [o for o in outcomes if o[0] == "http_503" and "no endpoint is ready" in o[1]]
    kinds = [k for k, d in outcomes if (k, d) not in refused]
    assert all(k in ("ok", "stream_ok", "stream_error") for k in kinds), outcomes
    assert kinds.count("ok") >= 2
    return {"detected_s": detected, "healed_s": healed,
            "ready_after_s": group["last_recovery"]["ready_after_s"], "cold_start_s": cold[victim],
            "outcomes": {**{k: kinds.count(k) for k in set(kinds)}, "refused_at_arrival": len(refused)}}


@pytest.mark.slow
def test_killed_or_stopped_member_is_replaced_behind_the_router(node: SupervisorNode, tiny_mixtral: Path,
                                                                tmp_path: Path) -> None:
    port = free_port()
    router = spawn([sys.executable, "-m", "lbd", "route", "--host", "127.0.0.1", "--port", str(port),
                    "--upstreams", f"supervisor://127.0.0.1:{node.sport}", "--supervisor-poll-interval-s",
                    "0.1", "--health-check-interval-s", "0.2", "--retry-budget-s", "120",
                    "--max-retries", "4"],
                   log=tmp_path / "router.log")
    url = f"http://127.0.0.1:{port}"
    try:
        node.wait_ready(60)
        wait_http(url + "/readyz", timeout=60, proc=router)
        killed = _heal(node, 1, signal.SIGKILL, url, str(tiny_mixtral))
        print(f"SIGKILL of rank 1: group ready again {killed['ready_after_s']:.1f} s after the failure (one "
              f"rank's cold start: {killed['cold_start_s']:.1f} s); requests {killed['outcomes']}")
        stopped = _heal(node, 0, signal.SIGSTOP, url, str(tiny_mixtral))
        print(f"SIGSTOP of rank 0: detected in {stopped['detected_s']:.1f} s (bound "
              f"{node.detection_bound_s:.1f} s), ready again {stopped['ready_after_s']:.1f} s after the "
              f"failure (cold start {stopped['cold_start_s']:.1f} s); requests {stopped['outcomes']}")
        # the bound plus the poll of our own test loop and a loaded machine's slack
        assert stopped["detected_s"] < node.detection_bound_s + 5.0
        retries = metric_value(httpx.get(url + "/metrics").text, "lbd_router_retries_total")
        print(f"requests the router retried: {retries:.0f}")
        assert retries >= 1  # requests cut before their first byte went again, and succeeded (above)
        metrics = node.get("/metrics").text
        assert metric_value(metrics, "lbd_supervisor_group_member_failures_total", rank="0") == 1.0
        assert metric_value(metrics, "lbd_supervisor_group_member_failures_total", rank="1") == 1.0
    finally:
        stop(router)


def _text(url: str, model: str, max_tokens: int) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


class Streams:
    """Greedy streams, one after another until stopped (``once``: one): (text, ended with [DONE], any error);
    one refused before its first byte (503: the group was re-forming) is sent again, as a router would."""

    def __init__(self, url: str, model: str, max_tokens: int, rank: int | None = None,
                 once: bool = False) -> None:
        self.body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True, "stream": True}
        self.headers = {"X-data-parallel-rank": str(rank)} if rank is not None else {}
        self.url, self.once, self.done, self.started = url, once, threading.Event(), threading.Event()
        self.results: list[tuple[str, bool, str | None]] = []
        self.refused = 0  # 503 before the first byte, as a router would retry elsewhere
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import orjson

        while not self.done.is_set():
            text, finished, error = [], False, None
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, headers=self.headers,
                              timeout=120) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        finished = True
                    elif line.startswith("data: "):
                        event = orjson.loads(line[6:])
                        error = error or (str(event["error"]) if "error" in event else None)
                        text += [c["text"] for c in event.get("choices", [])]
                        if len(text) >= 3:
                            self.started.set()
                if r.status_code == 503:  # arrived while the group re-formed: nothing started; again
                    self.refused += 1
                    time.sleep(0.1)
                    continue
                if r.status_code != 200:
                    error = f"HTTP {r.status_code}"
            self.results.append(("".join(text), finished, error))
            if self.once:
                break

    def stop(self) -> list[tuple[str, bool, str | None]]:
        self.done.set()
        self.thread.join(180)
        assert not self.thread.is_alive(), "a stream hung"
        return self.results


def _resize(node: SupervisorNode, size: int) -> dict[str, Any]:
    r = node.client.post("/scale", json={"data_parallel_size_local": size},
                         headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 202, r.text
    node.wait_for(lambda: node.status()["scaling"]["state"] != "running", 300, f"the resize to {size}")
    status = node.status()
    assert status["scaling"]["state"] == "done", status["scaling"]
    return status


def _pids(status: dict[str, Any]) -> dict[int, tuple[int, int]]:
    """rank -> (launcher pid, core pid)."""
    (group,) = status["groups"]
    cores = {m["rank"]: m["core_pid"] for m in group["members"]}
    return {r["rank"]: (r["pid"], cores.get(r["rank"])) for r in status["ranks"]}


@pytest.mark.slow
def test_moe_group_resizes_2_4_2_under_streams_keeping_survivors(node: SupervisorNode, tiny_mixtral: Path,
                                                                 tmp_path: Path) -> None:
    """POST /scale 2 -> 4 -> 2 while greedy streams run on a rank that stays, and on the shrink one more
    through `lbd route` on a rank that leaves (cut with a retryable 503 there, resumed by the router on a
    rank that stays): every stream completes with the text the group gave before, the new ranks serve the
    same text, a size the 4 experts do not divide is refused with the reason (the node unchanged), and the
    two original ranks keep their processes (launcher and core) throughout. (Was test_moe_resize.py, on a
    group of its own.)"""
    router = RouterServer("--upstreams", f"supervisor://127.0.0.1:{node.sport}", "--migrate-pinned",
                          "--supervisor-poll-interval-s", "0.1", "--retry-budget-s", "60",
                          log=tmp_path / "router.log")
    model, urls = str(tiny_mixtral), [node.rank_url(r) for r in range(4)]
    try:
        node.wait_ready(60)
        router.wait_ready()
        t0 = time.monotonic()
        want, long = _text(urls[0], model, 12), _text(urls[1], model, TOKENS)
        before = _pids(node.status())
        r = node.client.post("/scale", json={"data_parallel_size_local": 3},
                             headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 409 and "4 experts do not split evenly over 3 ranks" in r.text, r.text
        assert len(node.status()["ranks"]) == 2 and node.get("/readyz").status_code == 200
        for size in (4, 2):
            streams, moving = Streams(urls[1], model, TOKENS), None
            if size == 2:  # a stream on rank 3, which leaves: cut with a retryable 503, the router resumes it
                node.wait_for(lambda: httpx.post(router.url + "/v1/completions", timeout=30,
                                                 headers={"X-data-parallel-rank": "3"},
                                                 json={"model": model, "prompt": "hi", "max_tokens": 1}
                                                 ).status_code == 200, 30, "the router to reach rank 3")
                moving = Streams(router.url, model, TOKENS, rank=3, once=True)
                assert moving.started.wait(60)
            started = time.monotonic()
            status = _resize(node, size)
            took = time.monotonic() - started
            results = streams.stop() + (moving.stop() if moving is not None else [])
            (group,) = status["groups"]
            assert group["size"] == size and group["ready"] and len(status["ranks"]) == size
            assert all(r == (long, True, None) for r in results), results
            assert {r: before[r] for r in (0, 1)} == {r: _pids(status)[r] for r in (0, 1)}
            assert [_text(u, model, 12) for u in urls[:size]] == [want] * size
            print(f"resize to {size}: done in {took:.1f} s, {len(results)} streams of {TOKENS} tokens all "
                  f"whole ({streams.refused} refused at arrival while the group re-formed, sent again)")
        print("the router's moves of the stream on rank 3:", router.status()["migrations"]["moves"])
        # rank 3's stream: cut with a retryable 503 (an error event), resumed once on a rank that stays (after
        # 503s before the first byte, reason "overloaded", from ranks still re-forming or leaving)
        moves = router.status()["migrations"]["moves"]  # reason -> outcome -> count
        metrics = node.get("/metrics").text
        assert 'lbd_supervisor_group_member_joined{rank="1"} 1.0' in metrics and 'rank="3"' not in metrics
        assert "error_event" in moves and sum(by.get("resumed", 0) for by in moves.values()) == 1, moves
        print(f"whole test after the group was ready: {time.monotonic() - t0:.1f} s")
    finally:
        router.close()


@pytest.mark.slow
def test_group_across_two_supervisors_heals_through_the_remote_coordinator(tiny_mixtral: Path,
                                                                            tmp_path: Path) -> None:
    """Two `lbd supervise` nodes of one group (rank 0 with the coordinator, rank 1 alone), as on two
    machines: the second node reads and tells the coordinator at --data-parallel-address over HTTP."""
    rpc = free_port_run(4)
    group_flags = ["--enable-expert-parallel", "--data-parallel-size", "2", "--data-parallel-size-local", "1",
                   "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc),
                   "--restart-backoff-initial-s", "0"]
    head = SupervisorNode(tiny_mixtral, 1, *group_flags, "--node-rank", "0", log=tmp_path / "head.log")
    other = SupervisorNode(tiny_mixtral, 1, *group_flags, "--node-rank", "1", log=tmp_path / "other.log")
    try:
        for node in (head, other):
            node.wait_for(lambda n=node: n.get("/readyz").status_code == 200, 300, "the group")
        remote = _group(other)
        assert not remote["coordinator"]["local"] and remote["coordinator"]["pid"] is None
        assert [(m["rank"], m["local"], m["joined"]) for m in remote["members"]] == [(0, False, True),
                                                                                     (1, True, True)]
        rank1 = other.status()["ranks"][0]
        assert rank1["rank"] == 1
        ok = _complete(rank1["url"], str(tiny_mixtral), rank=1)
        assert ok.status_code == 200, ok.text
        head_pid = head.status()["ranks"][0]["pid"]
        generation = _group(head)["generation"]
        other.signal_rank(1, signal.SIGKILL)
        for node in (head, other):
            node.wait_for(lambda n=node: (_group(n)["generation"] or 0) > generation
                          and n.get("/readyz").status_code == 200, 300, "the group healed")
        assert head.status()["ranks"][0]["pid"] == head_pid
        assert _group(other)["last_recovery"]["rank"] == 1
        assert _complete(other.status()["ranks"][0]["url"], str(tiny_mixtral), rank=1).status_code == 200
    finally:
        other.close()
        head.close()
    assert not head.marked_processes() and not other.marked_processes()


def test_a_member_restarted_after_a_resize_starts_at_the_new_size() -> None:
    argv = ["python", "-m", "lbd.engine", "--data-parallel-rank", "1", "--data-parallel-size", "2",
            "--data-parallel-size-local", "2", "--port", "8001"]
    assert with_size(argv, 4) == [*argv[:6], "4", argv[7], "4", *argv[9:]]
