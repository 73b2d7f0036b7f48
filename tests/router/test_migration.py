"""`lbd route` resumes a request on another rank when its rank fails mid-answer (lbd.router.migration).

Two real engine ranks of the slower tiny Llama, each behind a stand-in for a flaky link (``LinkCut``), behind
one `lbd route`. A greedy 120-token answer is broken after 40 tokens by a rank SIGKILL, a link reset or
a SIGKILL of the rank's core alone; the client's answer must equal the unbroken run's, with one ``[DONE]``,
one ``id`` and ``usage.completion_tokens`` 120. A killed rank is started again on its port in the background
while the next test runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support import metric_value, settled
from support.linkcut import LinkCut
from support.procs import free_port, spawn, stop, wait_http
from support.tiny import make_tiny_llama

MODEL = "tiny"
TOKENS = 120
BREAK_AT = 40
PROMPT = "def add(a, b): return a + b # numbers 0123456789 and symbols"
MESSAGES = [{"role": "user", "content": "Count the numbers 0123456789 and add them."}]
FAST = ("--health-check-interval-s", "0.3", "--health-check-timeout-s", "1", "--health-failure-threshold",
        "1", "--scrape-interval-ms", "200", "--kv-events", "off", "--debug-headers")


class Rank:
    """One `python -m lbd.engine` on a fixed port (it starts again on the same one), behind a LinkCut."""

    def __init__(self, model: Path, log: Path, number: int) -> None:
        self.model, self.log, self.number = model, log, number
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.link = LinkCut(self.port)
        self.proc: subprocess.Popen | None = None
        self.ready = threading.Event()
        self.core_pid = 0

    def start(self) -> None:
        self.ready.clear()
        argv = [sys.executable, "-m", "lbd.engine", "--host", "127.0.0.1", "--port", str(self.port),
                "--model", str(self.model), "--served-model-name", MODEL, "--kv-cache-memory-bytes", "64MiB",
                "--data-parallel-rank", str(self.number), "--data-parallel-size", "2"]
        self.proc = spawn(argv, log=self.log)
        wait_http(self.url + "/health", timeout=180, proc=self.proc)
        self.core_pid = httpx.get(self.url + "/status", timeout=5).json()["core_pid"]
        self.ready.set()

    def restart_soon(self) -> None:
        assert self.proc is not None
        stop(self.proc, timeout=5)
        threading.Thread(target=self.start, daemon=True).start()

    def kill(self) -> None:
        """SIGKILL the whole rank (its API server and core)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)

    def kill_core(self) -> None:
        """SIGKILL the rank's core process alone: its API server lives on and fails the core's requests."""
        os.kill(self.core_pid, signal.SIGKILL)

    def close(self) -> None:
        self.link.close()
        if self.proc is not None:
            stop(self.proc)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Rank]]:
    # 8 layers, 512 wide: a 120-token answer takes about 0.6 s unloaded, so a fault after 40 tokens meets a
    # rank that is still generating (the 2-layer Llama would have finished)
    model = make_tiny_llama(tmp_path_factory.mktemp("model"), layers=8, hidden=512, heads=8, kv_heads=2,
                            intermediate=2048, max_pos=1024)
    logs = tmp_path_factory.mktemp("ranks")
    rs = [Rank(model, logs / f"rank{i}.log", i) for i in range(2)]
    threads = [threading.Thread(target=r.start) for r in rs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert all(r.ready.is_set() for r in rs), "a rank did not start"
        yield rs
    finally:
        for r in rs:
            r.close()


def start_router(ranks: list[Rank], log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    ups = ",".join(r.link.url for r in ranks)
    proc = spawn([sys.executable, "-m", "lbd", "route", "--host", "127.0.0.1", "--port", str(port),
                  "--upstreams", ups, *FAST, *extra], log=log)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", timeout=60, proc=proc)
    return proc, url


@pytest.fixture(scope="module")
def router(ranks: list[Rank], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, url = start_router(ranks, tmp_path_factory.mktemp("router") / "router.log")
    try:
        yield url
    finally:
        stop(proc)


@pytest.fixture(autouse=True)
def all_ranks_serving(ranks: list[Rank], router: str) -> None:
    """Both ranks up (a killed one was started again) and in the router's rotation."""
    for r in ranks:
        assert r.ready.wait(180), f"rank {r.url} did not come back"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        eps = httpx.get(router + "/router/status", timeout=5).json()["endpoints"]
        if len(eps) == 2 and all(e["state"] == "ready" for e in eps):
            return
        time.sleep(0.1)
    raise AssertionError(f"endpoints not all serving: {eps}")


def body(kind: str, stream: bool = True, **extra: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"model": MODEL, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
                         "stream": stream, **extra}
    if stream:
        b["stream_options"] = {"include_usage": True}
    if kind == "chat":
        b["messages"] = MESSAGES
    else:
        b["prompt"] = PROMPT
    return b


def path(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def rank_of(ranks: list[Rank], endpoint: str) -> Rank:
    return next(r for r in ranks if endpoint.rstrip("/").endswith(f":{r.link.port}"))


def streamed(router: str, kind: str, fault: Any = None, headers: dict[str, str] | None = None,
             **extra: Any) -> dict[str, Any]:
    """One streamed request; ``fault(endpoint)`` runs once BREAK_AT chunks with text arrived."""
    got: dict[str, Any] = {"text": "", "ids": set(), "done": 0, "errors": [], "usage": None, "finish": None,
                           "created": set(), "models": set(), "chunks": 0, "logprobs": []}
    req = body(kind, **extra)
    with httpx.stream("POST", router + path(kind), json=req, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        endpoint = r.headers["x-lbd-endpoint"]
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                got["done"] += 1
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                got["errors"].append(ev["error"])
                continue
            got["ids"].add(ev["id"])
            got["created"].add(ev["created"])
            got["models"].add(ev["model"])
            if ev.get("usage"):
                got["usage"] = ev["usage"]
            for c in ev["choices"]:
                assert "token_ids" not in c and "prompt_token_ids" not in ev, "token ids leaked to the client"
                text = c["text"] if kind == "cmpl" else c["delta"].get("content", "")
                lp = c.get("logprobs")
                if lp and kind == "cmpl":
                    got["logprobs"] += zip(lp["tokens"], lp["text_offset"], lp["token_logprobs"], strict=True)
                elif lp:
                    got["logprobs"] += [(e["token"], e["logprob"]) for e in lp["content"]]
                got["text"] += text or ""
                got["finish"] = c.get("finish_reason") or got["finish"]
                if text:
                    got["chunks"] += 1
                    if got["chunks"] == BREAK_AT and fault is not None:
                        fault(endpoint)
    return got


@pytest.fixture(scope="module")
def unbroken(router: str, ranks: list[Rank]) -> dict[str, dict[str, Any]]:
    for r in ranks:
        r.ready.wait(180)
    return {kind: streamed(router, kind) for kind in ("cmpl", "chat")}


def fault_of(name: str, ranks: list[Rank]) -> Any:
    def fault(endpoint: str) -> None:
        rank = rank_of(ranks, endpoint)
        if name == "reset":
            assert rank.link.reset() > 0
            return
        rank.kill() if name == "kill" else rank.kill_core()
        time.sleep(0.2)
        rank.restart_soon()

    return fault


def test_unbroken_runs_are_whole(unbroken: dict[str, dict[str, Any]]) -> None:
    for got in unbroken.values():
        assert got["done"] == 1 and not got["errors"] and got["usage"]["completion_tokens"] == TOKENS
        assert got["finish"] == "length" and len(got["ids"]) == 1


@pytest.mark.parametrize("kind", ["cmpl", "chat"])
@pytest.mark.parametrize("fault", ["reset", "kill", "core"])
def test_a_stream_broken_mid_answer_is_finished_elsewhere(router: str, ranks: list[Rank], unbroken: dict,
                                                          kind: str, fault: str) -> None:
    before = resumed(router)
    got = streamed(router, kind, fault_of(fault, ranks))
    want = unbroken[kind]
    assert settled(lambda: resumed(router), before + 1) == before + 1, "the stream was not moved"
    assert not got["errors"], got["errors"]
    assert got["text"] == want["text"]
    assert got["done"] == 1
    assert len(got["ids"]) == 1 and len(got["created"]) == 1 and got["models"] == {MODEL}
    assert got["usage"]["completion_tokens"] == TOKENS
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert got["finish"] == "length"


def resumed(router: str, outcome: str = "resumed") -> int:
    moves = httpx.get(router + "/router/status", timeout=5).json()["migrations"]["moves"]
    return sum(by.get(outcome, 0) for by in moves.values())


def retried(router: str) -> float:
    return metric_value(httpx.get(router + "/metrics", timeout=5).text, "lbd_router_retries_total")


def busy_rank(ranks: list[Rank]) -> Rank:
    """The rank with a request in flight (polled)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for r in ranks:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(r.url + "/load", timeout=2).json()["server_load"] > 0:
                    return r
        time.sleep(0.01)
    raise AssertionError("no rank took the request")


@pytest.mark.parametrize("fault", ["kill", "core"])
def test_a_whole_answer_broken_mid_answer_is_answered_whole(router: str, ranks: list[Rank], unbroken: dict,
                                                            fault: str) -> None:
    result: dict[str, Any] = {}

    def call() -> None:
        result["r"] = httpx.post(router + "/v1/completions", json=body("cmpl", stream=False), timeout=120)

    retries = retried(router)
    t = threading.Thread(target=call)
    t.start()
    rank = busy_rank(ranks)
    time.sleep(0.05)
    rank.kill() if fault == "kill" else rank.kill_core()
    time.sleep(0.2)
    rank.restart_soon()
    t.join(120)
    r = result["r"]
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["choices"][0]["text"] == unbroken["cmpl"]["text"]
    assert data["usage"]["completion_tokens"] == TOKENS
    assert "token_ids" not in data["choices"][0]
    # it failed on the killed rank before its first byte, and was answered again elsewhere
    assert retried(router) == retries + 1


def test_a_chat_of_several_choices_ends_with_an_error_naming_why(router: str, ranks: list[Rank]) -> None:
    """(A chat with tools is resumed as a chat: test_migration_exact.py.)"""
    before, moved = resumed(router, "impossible"), resumed(router)
    got = streamed(router, "chat", fault_of("reset", ranks), n=2)
    assert settled(lambda: (resumed(router, "impossible"), resumed(router)), (before + 1, moved)) == (
        before + 1, moved)
    assert got["done"] == 1
    assert len(got["errors"]) == 1
    assert "n > 1" in got["errors"][0]["message"]


def test_migration_limit_0_ends_the_stream_as_before(ranks: list[Rank], tmp_path: Path) -> None:
    proc, url = start_router(ranks, tmp_path / "router0.log", "--migration-limit", "0")
    try:
        got = streamed(url, "cmpl", fault_of("reset", ranks))
    finally:
        stop(proc)
    assert got["done"] == 1
    assert [e["message"] for e in got["errors"]] == [
        "upstream failed mid-stream (UpstreamError); the response is incomplete"]
    assert got["usage"] is None


def test_a_stop_string_after_the_move_ends_the_answer_as_unbroken(router: str, ranks: list[Rank],
                                                                   unbroken: dict) -> None:
    text = unbroken["cmpl"]["text"]
    # a stop string well after the break (the chunk of token 40 is at most a few characters a token in)
    at = next(i for i in range(len(text) * 2 // 3, len(text) - 3) if text.find(text[i:i + 3]) == i)
    stop = text[at:at + 3]
    want = streamed(router, "cmpl", stop=[stop])
    assert want["text"] == text[:at] and want["finish"] == "stop"
    before = resumed(router)
    got = streamed(router, "cmpl", fault_of("reset", ranks), stop=[stop])
    assert settled(lambda: resumed(router), before + 1) == before + 1
    assert (got["text"], got["finish"], got["done"], got["errors"]) == (want["text"], "stop", 1, [])
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]


def test_a_pinned_stream_moves_only_with_migrate_pinned(router: str, ranks: list[Rank], unbroken: dict,
                                                        tmp_path: Path) -> None:
    pin = {"X-data-parallel-rank": "1"}
    before = resumed(router)
    got = streamed(router, "cmpl", fault_of("reset", ranks), headers=pin)
    assert resumed(router) == before  # not moved (no move is tried: nothing counted)
    assert got["done"] == 1 and [e["message"] for e in got["errors"]] == [
        "upstream failed mid-stream (UpstreamError); the response is incomplete"]
    proc, url = start_router(ranks, tmp_path / "router-pinned.log", "--migrate-pinned")
    try:
        got = streamed(url, "cmpl", fault_of("reset", ranks), headers=pin)
    finally:
        stop(proc)
    assert not got["errors"] and got["text"] == unbroken["cmpl"]["text"] and got["done"] == 1


@pytest.mark.parametrize("kind", ["cmpl", "chat"])
def test_logprobs_continue_across_a_move(router: str, ranks: list[Rank], kind: str) -> None:
    extra = {"logprobs": 1} if kind == "cmpl" else {"logprobs": True, "top_logprobs": 1}
    want = streamed(router, kind, **extra)
    before = resumed(router)
    got = streamed(router, kind, fault_of("reset", ranks), **extra)
    assert settled(lambda: resumed(router), before + 1) == before + 1
    assert got["text"] == want["text"] and not got["errors"]
    assert len(got["logprobs"]) == TOKENS
    assert [e[:-1] for e in got["logprobs"]] == [e[:-1] for e in want["logprobs"]]  # tokens (and offsets)
    assert [e[-1] for e in got["logprobs"]] == pytest.approx([e[-1] for e in want["logprobs"]], abs=1e-3)


class Collector:
    """A stand-in OTLP/HTTP traces receiver (POST /v1/traces, protobuf) in a thread: names and attributes."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        spans = self.spans = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                size = int(self.headers["Content-Length"])
                req = ExportTraceServiceRequest.FromString(self.rfile.read(size))
                for sp in (sp for rs in req.resource_spans for ss in rs.scope_spans for sp in ss.spans):
                    attrs = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in sp.attributes}
                    spans.append({"name": sp.name, "parent": sp.parent_span_id.hex(), "attrs": attrs})
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_move_is_a_span_of_the_request(ranks: list[Rank], unbroken: dict, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    collector = Collector()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export every 50 ms
    proc, url = start_router(ranks, tmp_path / "router-traced.log", "--otlp-traces-endpoint", collector.url)
    try:
        got = streamed(url, "chat", fault_of("reset", ranks))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(s["name"] == "lbd.route" for s in collector.spans):
            time.sleep(0.05)
    finally:
        stop(proc)
        collector.server.shutdown()
    assert got["text"] == unbroken["chat"]["text"] and not got["errors"]
    moves = [s for s in collector.spans if s["name"] == "lbd.migrate"]
    assert len(moves) == 1 and moves[0]["attrs"]["lbd.migration.reason"] == "reset"
    assert moves[0]["attrs"]["lbd.migration.tokens_sent"] >= BREAK_AT
    assert moves[0]["parent"]  # inside the request's span


def test_moves_are_counted(router: str, ranks: list[Rank]) -> None:
    """A move counts once, by its reason and outcome, in /router/status and in the metric alike."""
    def tally() -> dict[tuple[str, str], int]:
        moves = httpx.get(router + "/router/status", timeout=5).json()["migrations"]["moves"]
        return {(reason, outcome): n for reason, by in moves.items() for outcome, n in by.items()}

    assert httpx.get(router + "/router/status", timeout=5).json()["migrations"]["limit"] == 3
    before = tally()
    got = streamed(router, "cmpl", fault_of("reset", ranks))
    assert not got["errors"] and got["done"] == 1

    def changed() -> dict[tuple[str, str], int]:  # counted a moment after the client's [DONE] (settled)
        return {k: n - before.get(k, 0) for k, n in tally().items() if n != before.get(k, 0)}

    assert settled(changed, {("reset", "resumed"): 1}) == {("reset", "resumed"): 1}
    after = tally()
    text = httpx.get(router + "/metrics", timeout=5).text
    assert metric_value(text, "lbd_router_migrations_total", reason="reset", outcome="resumed") == \
        after[("reset", "resumed")]
    assert "lbd_router_migration_gap_seconds_count" in text
