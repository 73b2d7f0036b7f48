"""An MoE DP group that loses a member mid-stream: `lbd route` finishes every stream it had started, the
survivor's included, once the group serves again (lbd.router.migration over `lbd supervise`).

A tiny Mixtral as one group of 2 DP ranks with expert parallelism (gloo on the CPU). Two greedy streams go
out, one to each rank (round robin); after some tokens rank 1 is SIGKILLed. The survivor's core cannot step
without its peer, so its stream breaks too (a retryable error event) while the supervisor re-forms the group;
the router waits for a rank to serve again (--retry-budget-s) and continues both streams there. Each client
must read the unbroken run's text, one ``[DONE]`` and the whole usage.

Cost (2 shared cores): one group start and one member restart, ~40-60 CPU-s: marked slow.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.node import SupervisorNode
from support.procs import free_port, spawn, stop, wait_http
from support.tiny import make_tiny_mixtral

TOKENS = 160
BREAK_AT = 20
PROMPT = "The experts of this model route every token"


class Stream:
    """One streamed completion read on its own thread; ``progress`` is set once BREAK_AT chunks arrived."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.text, self.done, self.errors, self.ids = "", 0, [], set()
        self.usage: dict[str, Any] | None = None
        self.endpoint = ""
        self.progress = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        chunks = 0
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=240) as r:
            assert r.status_code == 200, r.read()
            self.endpoint = r.headers.get("x-lbd-endpoint", "")
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    self.done += 1
                elif line.startswith("data: "):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        self.errors.append(ev["error"])
                        continue
                    self.ids.add(ev["id"])
                    self.usage = ev.get("usage") or self.usage
                    for c in ev["choices"]:
                        self.text += c.get("text") or ""
                        chunks += bool(c.get("text"))
                    if chunks >= BREAK_AT:
                        self.progress.set()
        self.progress.set()


def run_streams(url: str, model: str, fault: Any = None) -> list[Stream]:
    streams = [Stream(url, model) for _ in range(2)]
    for s in streams:
        s.thread.start()
    for s in streams:
        assert s.progress.wait(120), "a stream made no progress"
    if fault is not None:
        fault()
    for s in streams:
        s.thread.join(300)
        assert not s.thread.is_alive(), "a stream hung"
    return streams


@pytest.mark.slow
def test_a_group_member_lost_mid_stream_and_every_stream_finishes(tmp_path: Path) -> None:
    # wider than the session's tiny Mixtral, so a 160-token answer is still running when the member dies
    model = make_tiny_mixtral(tmp_path / "mixtral", layers=4, hidden=256, max_pos=1024)
    node = SupervisorNode(model, 2, "--enable-expert-parallel", "--restart-backoff-initial-s", "0",
                          log=tmp_path / "node.log")
    port = free_port()
    router = spawn([sys.executable, "-m", "lbd", "route", "--host", "127.0.0.1", "--port", str(port),
                    "--upstreams", f"supervisor://127.0.0.1:{node.sport}", "--policy", "round_robin",
                    "--supervisor-poll-interval-s", "0.1", "--health-check-interval-s", "0.2",
                    "--retry-budget-s", "200", "--kv-events", "off", "--debug-headers"],
                   log=tmp_path / "router.log")
    url = f"http://127.0.0.1:{port}"
    try:
        node.wait_ready(300)
        wait_http(url + "/readyz", timeout=60, proc=router)
        want, other = run_streams(url, str(model))
        assert want.text == other.text  # both ranks of the group answer alike
        assert want.done == 1 and not want.errors and want.usage["completion_tokens"] == TOKENS
        generation = node.status()["groups"][0]["generation"]

        broken = run_streams(url, str(model), lambda: node.signal_rank(1, signal.SIGKILL))
        assert len({s.endpoint for s in broken}) == 2, "round robin put both streams on one rank"
        assert node.status()["groups"][0]["generation"] > generation, "the group did not re-form"
        for s in broken:
            assert not s.errors, s.errors
            assert s.text == want.text
            assert s.done == 1 and len(s.ids) == 1
            assert s.usage is not None and s.usage["completion_tokens"] == TOKENS
            assert s.usage["prompt_tokens"] == want.usage["prompt_tokens"]
        moves = httpx.get(url + "/router/status", timeout=5).json()["migrations"]["moves"]
        resumed = sum(by.get("resumed", 0) for by in moves.values())
        print(f"moves by reason: {moves}")
        assert resumed >= 2  # the victim's stream and the survivor's
    finally:
        stop(router)
        node.close()
