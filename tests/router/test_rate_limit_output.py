"""Per-key token limits charge output a request does not cap (lbd.router.auth): through a real `lbd route`
with --rate-limit-tps, requests without max_tokens are throttled as if they asked for the default output
(a chat's ``UNCAPPED_OUTPUT_TOKENS``, a completion's 16), not let through for their prompt alone; paths that
generate nothing (/tokenize) pay their prompt only."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lbd.router.auth import requested_tokens
from support import RouterServer
from support.procs import free_port_run, spawn, stop, wait_http

STANDIN = Path(__file__).resolve().parents[1] / "support" / "fleet_standin.py"
MESSAGES = [{"role": "user", "content": "hi"}]


def test_requested_tokens_charges_a_default_without_a_cap() -> None:
    chat, cmpl = "/v1/chat/completions", "/v1/completions"
    assert requested_tokens(b'{"messages": []}', chat) == 2048
    assert requested_tokens(b'{"messages": [], "n": 2}', chat) == 4096
    assert requested_tokens(b'{"messages": [], "max_tokens": null}', chat) == 2048
    assert requested_tokens(b'{"prompt": "x"}', cmpl) == 16
    assert requested_tokens(b'{"input": "x", "max_output_tokens": 9}', "/v1/responses") == 9
    assert requested_tokens(b'{"messages": [], "max_completion_tokens": 5}', chat) == 5
    assert requested_tokens(b'{"messages": []}', "/tokenize") == 0


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterServer]:
    tmp = tmp_path_factory.mktemp("rate")
    base = free_port_run(2)
    fleet = spawn([sys.executable, str(STANDIN), "--ranks", "1", "--base-port", str(base), "--control-port",
                   str(base + 1), "--no-push"], log=tmp / "fleet.log")
    wait_http(f"http://127.0.0.1:{base}/health", 30, fleet)
    r = RouterServer("--upstreams", f"http://127.0.0.1:{base}", "--api-key", "k-chat", "k-cmpl", "k-tok",
                     "--rate-limit-tps", "2", "--rate-limit-burst-s", "100", log=tmp / "router.log")
    try:
        r.wait_ready()
        yield r
    finally:
        r.close()
        stop(fleet)


def _post(router: RouterServer, key: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(router.url + path, json={"model": "standin-model", **body}, timeout=30,
                      headers={"Authorization": f"Bearer {key}"})


def test_chats_without_max_tokens_are_throttled(router: RouterServer) -> None:
    first = _post(router, "k-chat", "/v1/chat/completions", {"messages": MESSAGES})
    assert first.status_code == 200, first.text
    second = _post(router, "k-chat", "/v1/chat/completions", {"messages": MESSAGES})
    assert second.status_code == 429, second.text  # 2,048 output tokens charged against a bucket of 200
    assert int(second.headers["retry-after"]) >= 5


def test_completions_without_max_tokens_pay_the_default(router: RouterServer) -> None:
    codes = [_post(router, "k-cmpl", "/v1/completions", {"prompt": "hi"}).status_code for _ in range(30)]
    # ~17 tokens each, against a bucket of 200 refilled at 2/s
    assert 200 in codes and 429 in codes and codes.index(429) <= 16, codes


def test_paths_that_generate_nothing_pay_their_prompt(router: RouterServer) -> None:
    codes = [_post(router, "k-tok", "/tokenize", {"messages": MESSAGES}).status_code for _ in range(10)]
    assert 429 not in codes, codes
