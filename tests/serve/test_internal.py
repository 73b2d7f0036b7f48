"""`lbd serve --data-parallel-size 2` on one machine: vLLM's internal load balancing from lbd's parts."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from lbd.router.admission import QUEUE_FULL
from support import free_port_run
from support.deploy_harness import SIM_FLAGS, ServeNode, complete, rank_urls, successes

MARK = "LBD_TEST_DEPLOY_NODE"


def _marked(mark: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.pid != os.getpid() and p.environ().get(MARK) == mark and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
    return found


@pytest.fixture
def internal(tiny_llama: Path, tmp_path: Path) -> Iterator[tuple[ServeNode, str]]:
    base = free_port_run(4)  # router, 2 ranks, health port
    mark = uuid.uuid4().hex
    node = ServeNode(["--model", str(tiny_llama), *SIM_FLAGS, "--data-parallel-size", "2",
                      "--max-num-queued-reqs", "4", "--api-server-count", "2", "--host", "127.0.0.1",
                      "--port", str(base), "--rank-port", str(base + 1),
                      "--data-parallel-supervisor-port", str(base + 3),
                      "--dp-supervisor-probe-interval-s", "0.5"],
                     tmp_path / "serve.log", port=base, health_port=base + 3, env={MARK: mark})
    try:
        yield node, mark
    finally:
        node.close()
        for p in _marked(mark):
            with contextlib.suppress(psutil.Error):
                p.kill()


def _open_stream(client: httpx.Client, base: str) -> tuple[httpx.Response, Iterator[str]]:
    """A streamed request that stays in flight (its line iterator is kept: dropping it closes the stream)."""
    req = client.build_request("POST", base + "/v1/completions",
                               json={"prompt": "hold", "max_tokens": 400, "stream": True})
    resp = client.send(req, stream=True)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    next(lines)  # the first event: the request is in flight
    return resp, lines


def test_one_port_two_ranks_queue_limit_over_both_and_sigterm_drains(internal: tuple[ServeNode, str]) -> None:
    """--max-num-queued-reqs 4 over the deployment: the 5th request in flight gets vLLM's 503 (per rank it
    would be the 9th); SIGTERM lets a stream finish and leaves no process behind."""
    node, mark = internal
    node.wait_ready()
    node.wait_for(lambda: node.get(node.api + "/readyz").status_code == 200, 30, "router /readyz")
    status = node.status()
    assert status["ready_ranks"] == 2 and status["deployment"]["router"]["workers"] == 2
    urls = rank_urls(status)
    assert all(u.startswith("http://127.0.0.1:") for u in urls.values())  # ranks on loopback only
    before = {r: successes(u) for r, u in urls.items()}
    with httpx.Client(timeout=60.0) as client:
        for _ in range(4):  # spread over both ranks by the router
            assert complete(node.api, max_tokens=4).status_code == 200
        streams = [_open_stream(client, node.api) for _ in range(4)]
        try:
            fifth = complete(node.api)
            assert fifth.status_code == 503
            error = fifth.json()["error"]
            assert error["message"] == QUEUE_FULL and error["code"] == 503
        finally:
            for resp, _ in streams:
                resp.close()
        # the client went away: the router's counts are back to zero and it admits again
        node.wait_for(lambda: complete(node.api).status_code == 200, 20, "admission after the streams closed")
    after = {r: successes(u) for r, u in urls.items()}
    assert all(after[r] > before[r] for r in urls), (before, after)
    _sigterm_drains_and_leaves_nothing_behind(node, mark)


def _sigterm_drains_and_leaves_nothing_behind(node: ServeNode, mark: str) -> None:
    assert len(_marked(mark)) >= 7  # serve, supervise, 2 x (launcher + core), router parent + 2 workers
    with httpx.Client(timeout=60.0) as client:
        resp = client.send(client.build_request("POST", node.api + "/v1/completions",
                                                json={"prompt": "drain", "max_tokens": 200, "stream": True}),
                           stream=True)
        lines = resp.iter_lines()
        first = next(lines)
        os.killpg(node.proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        events = [e for e in (first, *lines) if e]  # SSE events without the blank separators
    done = [e for e in events if e.startswith("data: ") and e != "data: [DONE]"]
    assert events[-1] == "data: [DONE]"
    texts = [json.loads(e[6:])["choices"][0].get("text") for e in done]
    assert json.loads(done[-1][6:])["choices"][0]["finish_reason"] == "length"  # ran to its end
    assert sum(bool(t) for t in texts) >= 100, len(texts)
    assert node.proc.wait(40) == 0
    assert time.monotonic() - t0 < 40
    leftovers = _marked(mark)
    assert leftovers == [], [p.cmdline() for p in leftovers]
