"""`lbd supervise` resizing a tiny Mixtral MoE group (expert parallel, gloo on the CPU) 2 -> 4 -> 2 through
POST /scale while greedy streams run on a rank that stays, and on the shrink one more through `lbd route` on a
rank that leaves (cut with a retryable 503 there, resumed by the router on a rank that stays): every stream
completes with the text the group gave before, the new ranks serve the same text, a size the 4 experts do
not divide is refused with the reason (the node unchanged), and the two original ranks keep their processes
(launcher and core) throughout.

Cost (2 shared cores): one group start, two more ranks, two re-forms, a router: about 90 s; marked slow.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from lbd.supervisor.group import with_size
from support import RouterServer
from support.node import SupervisorNode
from support.procs import free_port_run

PROMPT = "The capital of France is"
ADMIN = "moe-scale-token"
TOKENS = 120  # per stream: a few seconds on the CPU, across the re-form


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
def test_moe_group_resizes_2_4_2_under_streams_keeping_survivors(tiny_mixtral: Path, tmp_path: Path) -> None:
    port = free_port_run(4)
    node = SupervisorNode(tiny_mixtral, 2, "--enable-expert-parallel", "--port", str(port), "--admin-token",
                          ADMIN, "--shutdown-timeout", "1", "--scale-down-drain-timeout-s", "0",
                          log=tmp_path / "node.log")
    router = RouterServer("--upstreams", f"supervisor://127.0.0.1:{node.sport}", "--migrate-pinned",
                          "--supervisor-poll-interval-s", "0.1", "--retry-budget-s", "60",
                          log=tmp_path / "router.log")
    model, urls = str(tiny_mixtral), [f"http://127.0.0.1:{port + r}" for r in range(4)]
    try:
        node.wait_ready(300)
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
        node.close()
    assert not node.marked_processes()


def test_a_member_restarted_after_a_resize_starts_at_the_new_size() -> None:
    argv = ["python", "-m", "lbd.engine", "--data-parallel-rank", "1", "--data-parallel-size", "2",
            "--data-parallel-size-local", "2", "--port", "8001"]
    assert with_size(argv, 4) == [*argv[:6], "4", argv[7], "4", *argv[9:]]
