"""Adapter-aware placement end to end (issue 44): `lbd route` over two real `--device sim --enable-lora`
ranks (two slots each, load time modelled by lbd.engine.core.sim_lora).

- Residency parsing on a real rank: its /telemetry ``lora`` section and its /metrics (lbd's resident and
  free-slot gauges: exact) give the same view; with only vLLM's ``lora_requests_info`` an idle resident
  adapter is invisible (the view says it is inexact).
- An adapter request goes to the rank holding it on device, and ``x-lbd-route-reason`` names the adapter
  scorer; a cold adapter's second request follows its first; a base-model request is not the scorer's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import pytest

from lbd.router.telemetry import lora_view, parse_metrics, parse_telemetry
from lbd.wire.core_messages import LoraState
from lbd.wire.load_state import LoadState, decode_state, encode_state
from support import RouterServer
from support.procs import EngineServer, stop

ADAPTERS = ("a=/adapters/a", "b=/adapters/b", "c=/adapters/c", "d=/adapters/d")


@pytest.fixture(scope="module")
def ranks(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineServer]]:
    tmp = tmp_path_factory.mktemp("adapter-routing")
    args = ("--device", "sim", "--max-model-len", "512", "--enable-lora", "--max-loras", "2",
            "--lora-modules", *ADAPTERS, "--log-level", "warning")
    with ThreadPoolExecutor(2) as pool:  # started side by side: each waits for its own /health
        futures = [pool.submit(EngineServer, tiny_llama, *args, log=tmp / f"rank{i}.log") for i in range(2)]
    try:
        yield [f.result() for f in futures]
    finally:
        for f in futures:
            if f.exception() is None:
                stop(f.result().proc)


def _complete(url: str, model: str, prompt: str = "hello " * 20, **kw) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2},
                   timeout=30, **kw)
    assert r.status_code == 200, r.text
    return r


def _until(check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def test_the_pushed_state_carries_residency_and_older_peers_still_decode() -> None:
    lora = LoraState(max_lora=4, running=["a"], device=["a", "b"], cpu=["a", "b", "c"], free_slots=2,
                     load_seconds={"a": 0.1, "b": 0.1, "c": 0.2})
    got = decode_state(encode_state(LoadState("i", 1, 0.0, lora=lora)))
    view = lora_view(msgspec.to_builtins(got.lora))
    assert (view.device, view.cpu, view.free_slots, view.max_loras) == ({"a", "b"}, {"a", "b", "c"}, 2, 4)
    assert view.known == {"a", "b", "c"} and view.exact
    older = msgspec.msgpack.encode(list(msgspec.msgpack.decode(encode_state(LoadState("i", 2, 0.0))))[:-1])
    assert decode_state(older).lora is None  # a publisher from before the field: no adapters reported
    assert lora_view({"device": "not a list", "free_slots": -3}) == type(view)()  # junk: nothing resident


def test_residency_from_telemetry_and_metrics(ranks: list[EngineServer]) -> None:
    rank = ranks[1].base_url
    _complete(rank, "b")
    _until(lambda: parse_telemetry(httpx.get(rank + "/telemetry", timeout=5).content).lora.device == {"b"}, 5)
    view = parse_telemetry(httpx.get(rank + "/telemetry", timeout=5).content).lora
    assert (view.cpu, view.free_slots, view.max_loras, view.exact) == ({"b"}, 1, 2, True)
    assert view.known >= {"b"}
    text = httpx.get(rank + "/metrics", timeout=5).text
    _until(lambda: parse_metrics(httpx.get(rank + "/metrics", timeout=5).text).lora == view, 5)
    # vLLM's view alone: the idle resident adapter is not there, and the view says it may be incomplete
    vllm_only = "\n".join(line for line in text.splitlines() if not line.startswith("lbd:lora"))
    guess = parse_metrics(vllm_only).lora
    assert guess is not None and not guess.exact and "b" not in guess.device and guess.max_loras == 2


def test_an_adapter_request_goes_where_it_is_resident(ranks: list[EngineServer], tmp_path: Path) -> None:
    urls = [r.base_url for r in ranks]
    _complete(urls[0], "a")  # rank 0 holds a, rank 1 holds b (from the test above, or now)
    _complete(urls[1], "b")
    router = RouterServer("--upstreams", ",".join(urls), "--debug-headers", "--policy", "predicted_ttft",
                          log=tmp_path / "router.log")
    try:
        router.wait_ready()
        _until(lambda: all((e.get("telemetry_push") or {}).get("state") == "pushed"
                           for e in router.status()["endpoints"]), 15)
        for model, home in (("a", urls[0]), ("b", urls[1]), ("a", urls[0]), ("b", urls[1])):
            r = _complete(router.url, model, prompt=f"question about {model} " * 10)
            reason = r.headers["x-lbd-route-reason"]
            assert (r.headers["x-lbd-endpoint"], reason.split(":")[0]) == (home, "adapter_resident (adapter)")
        first = _complete(router.url, "d")  # cold everywhere: its rendezvous home
        again = _complete(router.url, "d", prompt="another question " * 10)
        assert again.headers["x-lbd-endpoint"] == first.headers["x-lbd-endpoint"]
        assert again.headers["x-lbd-route-reason"].startswith(("adapter_resident", "adapter_cpu"))
        base = httpx.get(urls[0] + "/v1/models", timeout=5).json()["data"][0]["id"]
        assert "adapter" not in _complete(router.url, base).headers["x-lbd-route-reason"]
    finally:
        router.close()
