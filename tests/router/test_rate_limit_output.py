"""Per-key token limits charge the output a request produces (lbd.router.auth, lbd.router.metering), through
a real `lbd route` with --rate-limit-tps 2 and a bucket of 200 tokens (--rate-limit-burst-s 100):

- admission charges what a request may produce (its ``max_tokens``, else the path's default: a chat's
  ``UNCAPPED_OUTPUT_TOKENS``, a completion's 16), and the answer's end settles it on what was produced: a
  longer answer leaves the key in debt (a completion without max_tokens from a rank whose default is 600
  tokens), a shorter one gets the rest back (a chat of ~500 tokens pays ~500, not 2,048);
- whole answers are read for their usage; streams for their usage chunk, their token ids (a stream the
  router tracks for migration), else their events with text (--migration-limit 0); a client that goes away
  mid-stream pays what reached it, not nothing and not the whole charge;
- paths that generate nothing (/tokenize) pay their prompt only.

Fleet stand-in ranks (tests/support/fleet_standin.py, ``--default-max-tokens 600``) and a sim rank of lbd's
engine (tiny Llama, --max-model-len 512: a chat without max_tokens runs ~495 tokens, one event each).
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from lbd.router.auth import requested_tokens
from lbd.router.metering import Meter
from support import EngineServer, RouterServer
from support.procs import free_port_run, spawn, stop, wait_http

STANDIN = Path(__file__).resolve().parents[1] / "support" / "fleet_standin.py"
MESSAGES = [{"role": "user", "content": "hi"}]
LIMITS = ("--rate-limit-tps", "2", "--rate-limit-burst-s", "100")  # a bucket of 200 tokens, 2 tokens/s


def test_requested_tokens_charges_a_default_without_a_cap() -> None:
    chat, cmpl = "/v1/chat/completions", "/v1/completions"
    assert requested_tokens(b'{"messages": []}', chat) == 2048
    assert requested_tokens(b'{"messages": [], "n": 2}', chat) == 4096
    assert requested_tokens(b'{"messages": [], "max_tokens": null}', chat) == 2048
    assert requested_tokens(b'{"prompt": "x"}', cmpl) == 16
    assert requested_tokens(b'{"input": "x", "max_output_tokens": 9}', "/v1/responses") == 9
    assert requested_tokens(b'{"messages": [], "max_completion_tokens": 5}', chat) == 5
    assert requested_tokens(b'{"messages": []}', "/tokenize") == 0


def test_the_meter_reads_usage_else_events_with_text_across_writes() -> None:
    m = Meter()
    for piece in (b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n',
                  b'data: {"choices":[{"delta":{"cont', b'ent":"a"}}]}\n\ndata: {"choices":[{"text":"\\"te',
                  b'xt\\":\\"b"}]}\n\n', b'data: {"choices":[{"delta":{"content":"c"}}]}\n\n'):
        m.feed(piece)
    assert (m.produced, m.usage) == (3, None)  # the empty role delta and text inside text count nothing
    m.feed(b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1')
    m.feed(b'2,"total_tokens":15}}\n\n')  # a number split between two writes is read whole
    assert m.produced == 12
    whole = Meter()
    whole.feed(b'{"usage":{"input_tokens":3,"output_tokens":7,"output_tokens_details":{"reasoning_tokens":0}}}')
    assert whole.produced == 7


def _post(url: str, key: str, path: str, body: dict, model: str = "standin-model") -> httpx.Response:
    return httpx.post(url + path, json={"model": model, **body}, timeout=60,
                      headers={"Authorization": f"Bearer {key}"})


def _retry_after(r: httpx.Response) -> int:
    assert r.status_code == 429, r.text
    return int(r.headers["retry-after"])


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterServer]:
    tmp = tmp_path_factory.mktemp("rate")
    base = free_port_run(2)
    fleet = spawn([sys.executable, str(STANDIN), "--ranks", "1", "--base-port", str(base), "--control-port",
                   str(base + 1), "--no-push", "--default-max-tokens", "600", "--time-scale", "0.1"],
                  log=tmp / "fleet.log")
    wait_http(f"http://127.0.0.1:{base}/health", 30, fleet)
    r = RouterServer("--upstreams", f"http://127.0.0.1:{base}", "--api-key", "k-cmpl", "k-stream", "k-tok",
                     "k-capped", *LIMITS, log=tmp / "router.log")
    try:
        r.wait_ready()
        yield r
    finally:
        r.close()
        stop(fleet)


def test_output_past_the_admission_charge_is_a_debt(router: RouterServer) -> None:
    """Charged 16 at admission, a completion without max_tokens that produced 600 leaves ~400 tokens of
    debt: the next one waits ~209 s (charged 16 only, ten more would have passed)."""
    for key, extra in (("k-cmpl", {}), ("k-stream", {"stream": True})):  # (a stream: its usage chunk)
        first = _post(router.url, key, "/v1/completions", {"prompt": "hi", **extra})
        assert first.status_code == 200 and first.text.count("ok ") == 600, first.text[:200]
        wait = _retry_after(_post(router.url, key, "/v1/completions", {"prompt": "hi"}))
        # (17 needed - (200 bucket - 1 prompt - 600 produced)) / 2 per s, less what refilled meanwhile
        assert 150 <= wait <= 215, wait


def test_a_capped_request_pays_its_output(router: RouterServer) -> None:
    codes = [_post(router.url, "k-capped", "/v1/chat/completions",
                   {"messages": MESSAGES, "max_tokens": 16}).status_code for _ in range(30)]
    # ~17 tokens each, against a bucket of 200 refilled at 2/s
    assert 200 in codes and 429 in codes and codes.index(429) <= 16, codes


def test_paths_that_generate_nothing_pay_their_prompt(router: RouterServer) -> None:
    codes = [_post(router.url, "k-tok", "/tokenize", {"messages": MESSAGES}).status_code for _ in range(10)]
    assert 429 not in codes, codes


@pytest.fixture(scope="module")
def sim(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterServer, ...]]:
    """A sim rank of lbd's engine behind two routers: migration on (streams tracked by token ids) and off
    (streams read for their events)."""
    tmp = tmp_path_factory.mktemp("rate-sim")
    engine = EngineServer(tiny_llama, "--device", "sim", "--max-model-len", "512", "--served-model-name",
                          "tiny", log=tmp / "engine.log")
    keys = ("--api-key", "k-chat", "k-stream", "k-gone")
    routers = (RouterServer("--upstreams", engine.base_url, *keys, *LIMITS, log=tmp / "tracked.log"),
               RouterServer("--upstreams", engine.base_url, *keys, *LIMITS, "--migration-limit", "0",
                            log=tmp / "untracked.log"))
    try:
        for r in routers:
            r.wait_ready()
        yield routers
    finally:
        for r in routers:
            r.close()
        engine.close()


def _chat(url: str, key: str, **extra: object) -> httpx.Response:
    return _post(url, key, "/v1/chat/completions", {"messages": MESSAGES, **extra}, model="tiny")


def test_a_shorter_answer_gets_its_charge_back(sim: tuple[RouterServer, ...]) -> None:
    """A chat without max_tokens is charged 2,048 at admission and pays the ~495 tokens it produced: the next
    request waits ~250 s, not ~1,025 s. The two routers (own buckets, one sim rank) are checked side by side:
    the rank's steps are simulated time, which two sequences share."""
    def check(r: RouterServer) -> None:
        whole = _chat(r.url, "k-chat")
        assert whole.status_code == 200, whole.text
        produced = whole.json()["usage"]["completion_tokens"]
        assert 400 < produced < 512
        # (200 needed - (200 bucket - 2 prompt estimate - output)) / 2 per s, less what refilled meanwhile
        expect = (2 + produced) / 2
        assert expect - 60 <= _retry_after(_chat(r.url, "k-chat")) <= expect + 5
        stream = _chat(r.url, "k-stream", stream=True)  # no usage chunk asked for: ids or events counted
        assert stream.status_code == 200 and stream.text.count('"content":"') > 400
        assert expect - 60 <= _retry_after(_chat(r.url, "k-stream")) <= expect + 5

    with ThreadPoolExecutor(len(sim)) as pool:
        for done in [pool.submit(check, r) for r in sim]:
            done.result()  # (a failed check raises here)


def test_a_client_that_goes_away_pays_what_reached_it(sim: tuple[RouterServer, ...]) -> None:
    for r in sim:
        host, port = r.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            body = b'{"model":"tiny","stream":true,"messages":[{"role":"user","content":"hi"}]}'
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k-gone\r\n"
                      b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            got = b""
            while got.count(b'"content":"') < 60:
                got += s.recv(65536)
        time.sleep(0.5)  # the router sees the close and settles
        # it paid ~60-100 tokens, not nothing (then 120 would pass) and not 2,048 (then 40 would not)
        assert _chat(r.url, "k-gone", max_tokens=150).status_code == 429
        assert _chat(r.url, "k-gone", max_tokens=40).status_code == 200
