"""Adapter-aware placement end to end (issue 44): `lbd route` over two real `--device sim --enable-lora`
ranks (two slots each, load time modelled by lbd.engine.core.sim_lora).

- Residency parsing on a real rank: its /telemetry ``lora`` section and its /metrics (lbd's resident and
  free-slot gauges: exact) give the same view, down to the adapter the next load would evict; with only
  vLLM's ``lora_requests_info`` an idle resident adapter is invisible (the view says it is inexact).
- An adapter request goes to the rank holding it on device, and ``x-lbd-route-reason`` names the adapter
  scorer; a cold adapter's second request follows its first; a base-model request is not the scorer's.
- On demand (``lbd route --lora-modules``, lbd.router.adapter_loader): the router's /v1/models lists those
  adapters (``parent`` the ranks' base model, ``root`` the path) before any rank has them, once after one
  has; a burst for an adapter no rank lists
  shares one load on the rank the adapter scorer picks, which then lists it; an adapter nobody knows is still
  a 404; a rank without runtime loading (the third rank: no ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) answers the
  load with 404, and the client gets a 502 with that reason.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import pytest

from lbd.common.lora_modules import RUNTIME_ENV
from lbd.policies.base import LoraView
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
    runtime = [{RUNTIME_ENV: "1"}, {RUNTIME_ENV: "1"}, {RUNTIME_ENV: "0"}]  # the third: no runtime loading
    with ThreadPoolExecutor(3) as pool:  # started side by side: each waits for its own /health
        futures = [pool.submit(EngineServer, tiny_llama, *args, env=env, log=tmp / f"rank{i}.log")
                   for i, env in enumerate(runtime)]
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
    lora = LoraState(max_lora=4, running=["a"], waiting=["c"], device=["a", "b"], cpu=["a", "b", "c"],
                     free_slots=0, load_seconds={"a": 0.1, "b": 0.1, "c": 0.2}, evicts="b")
    got = decode_state(encode_state(LoadState("i", 1, 0.0, lora=lora)))
    view = lora_view(msgspec.to_builtins(got.lora))
    assert (view.device, view.cpu, view.free_slots, view.max_loras) == ({"a", "b"}, {"a", "b", "c"}, 0, 4)
    assert view.known == {"a", "b", "c"} and view.exact
    assert (view.busy, view.evicts) == ({"a", "c"}, "b")
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
    _until(lambda: parse_metrics(httpx.get(rank + "/metrics", timeout=5).text).lora == view, 5)
    _complete(rank, "c")  # both slots taken, none in use: the next load evicts b (least recently used)
    _until(lambda: parse_telemetry(httpx.get(rank + "/telemetry", timeout=5).content).lora.evicts == "b", 5)
    full = parse_telemetry(httpx.get(rank + "/telemetry", timeout=5).content).lora
    assert (full.device, full.free_slots) == ({"b", "c"}, 0)
    _until(lambda: parse_metrics(httpx.get(rank + "/metrics", timeout=5).text).lora == full, 5)

    def vllm_only() -> LoraView | None:  # the idle rank's /metrics without lbd's gauges
        text = httpx.get(rank + "/metrics", timeout=5).text
        return parse_metrics("\n".join(ln for ln in text.splitlines() if not ln.startswith("lbd:lora"))).lora

    # vLLM's view alone: once the finished request's step is published, the idle resident adapter is not
    # there, and the view says it may be incomplete (polled: the gauge is set once per engine step)
    _until(lambda: "b" not in getattr(vllm_only(), "device", {"b"}), 5)
    guess = vllm_only()
    assert guess is not None and not guess.exact and guess.max_loras == 2


def test_an_adapter_request_goes_where_it_is_resident(ranks: list[EngineServer], tmp_path: Path) -> None:
    urls = [r.base_url for r in ranks[:2]]
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


def _loads(router: RouterServer) -> dict[tuple[str, str], float]:
    """lbd_router_adapter_loads_total by (endpoint, outcome)."""
    text = httpx.get(router.url + "/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        if line.startswith("lbd_router_adapter_loads_total{"):
            labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:line.index("}")].split(","))
            out[(labels["endpoint"].strip('"'), labels["outcome"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    return out


def _models(url: str) -> set[str]:
    return {c["id"] for c in httpx.get(url + "/v1/models", timeout=5).json()["data"]}


def test_an_adapter_no_rank_lists_is_loaded_on_demand(ranks: list[EngineServer], tmp_path: Path) -> None:
    urls = [r.base_url for r in ranks[:2]]
    router = RouterServer("--upstreams", ",".join(urls), "--debug-headers", "--policy", "predicted_ttft",
                          "--lora-modules", "x=/adapters/x", '{"name": "y", "path": "/adapters/y"}',
                          log=tmp_path / "router.log")
    try:
        router.wait_ready()
        base = httpx.get(urls[0] + "/v1/models", timeout=5).json()["data"][0]["id"]
        _until(lambda: {"x", "y"} <= _models(router.url), 10)  # listed before any rank has them
        cards = {c["id"]: c for c in httpx.get(router.url + "/v1/models", timeout=5).json()["data"]}
        assert (cards["x"]["parent"], cards["x"]["root"], cards["y"]["root"]) == (base, "/adapters/x",
                                                                                  "/adapters/y")
        assert cards[base]["parent"] is None and cards["a"]["parent"] == base
        assert httpx.post(router.url + "/v1/completions", json={"model": "nope", "prompt": "hi"},
                          timeout=10).status_code == 404  # known to no rank and not to the router
        with ThreadPoolExecutor(4) as pool:  # a burst for a cold adapter: one load, all on one rank
            answers = list(pool.map(lambda i: _complete(router.url, "x", prompt=f"burst {i} " * 8), range(4)))
        homes = {r.headers["x-lbd-endpoint"] for r in answers}
        assert len(homes) == 1, homes
        home = homes.pop()
        reasons = [r.headers["x-lbd-route-reason"] for r in answers]
        loaded = "adapter_loaded (adapter): adapter x loaded on demand"
        assert any(r.startswith(loaded) for r in reasons), reasons
        assert _loads(router) == {(home, "loaded"): 1.0}
        assert "x" in _models(home)
        listed = [c["id"] for c in httpx.get(router.url + "/v1/models", timeout=5).json()["data"]]
        assert listed.count("x") == 1 and listed.count("y") == 1  # never twice, loaded or not
        again = _complete(router.url, "x", prompt="and again " * 8)  # now resident: no second load
        assert again.headers["x-lbd-endpoint"] == home and _loads(router) == {(home, "loaded"): 1.0}
    finally:
        router.close()


def test_a_failed_load_answers_with_the_ranks_reason(ranks: list[EngineServer], tmp_path: Path) -> None:
    router = RouterServer("--upstreams", ranks[2].base_url, "--lora-modules", "x=/adapters/x",
                          log=tmp_path / "router.log")
    try:
        router.wait_ready()
        r = httpx.post(router.url + "/v1/completions", json={"model": "x", "prompt": "hi", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 502, r.text
        message = r.json()["error"]["message"]
        assert message.startswith(f"loading LoRA adapter 'x' on {ranks[2].base_url} failed: 404"), message
        assert _complete(router.url, "a").status_code == 200  # the rank's own adapters still serve
    finally:
        router.close()
