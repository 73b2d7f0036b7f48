"""`lbd serve --enable-lora` over real HTTP (one server for the module): adapters picked by ``model``, listed
in /v1/models with their parent, loaded and unloaded at run time behind VLLM_ALLOW_RUNTIME_LORA_UPDATING with
vLLM's statuses and messages, refused with the reason, and reported on /metrics and /telemetry; bad flags
exit 2 naming the flag."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support import metric_value, settled
from support.lora import ATTENTION, MLP, make_adapter
from support.procs import engine_server


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"full": make_adapter(root / "full", tiny_llama, seed=1, targets=ATTENTION + MLP),
            "attn": make_adapter(root / "attn", tiny_llama, rank=4, alpha=8, seed=2, targets=("q_proj",)),
            "dora": make_adapter(root / "dora", tiny_llama, seed=3, use_dora=True),
            "lm_head": make_adapter(root / "lm_head", tiny_llama, seed=4, targets=("q_proj",)),
            "missing": root / "missing"}


@pytest.fixture(scope="module")
def server(tiny_llama: Path, adapters: dict[str, Path]) -> Iterator[str]:
    # a target module PEFT writes but the engine refuses
    cfg = adapters["lm_head"] / "adapter_config.json"
    cfg.write_text(cfg.read_text().replace('["q_proj"]', '["q_proj", "lm_head"]'))
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    module = json.dumps({"name": "full", "path": str(adapters["full"]), "base_model_name": str(tiny_llama)})
    with engine_server(tiny_llama, "--device", "cpu", "--enable-lora", "--max-loras", "2", "--max-lora-rank",
                       "8", "--lora-modules", module, "--kv-cache-memory-bytes", str(32 << 20),
                       "--log-level", "warning", env=env) as e:
        yield e.base_url


def _complete(url: str, model: str, prompt: str = "The capital of France is") -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8,
                                                     "temperature": 0}, timeout=30)


def test_models_and_requests_by_adapter(server: str, tiny_llama: Path, adapters: dict[str, Path]) -> None:
    cards = {c["id"]: c for c in httpx.get(server + "/v1/models").json()["data"]}
    assert cards["full"]["parent"] == str(tiny_llama) and cards["full"]["root"] == str(adapters["full"])
    assert cards[str(tiny_llama)]["parent"] is None
    base, full = _complete(server, str(tiny_llama)), _complete(server, "full")
    assert base.status_code == full.status_code == 200
    assert full.json()["model"] == "full"
    assert full.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]
    missing = _complete(server, "nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "The model `nope` does not exist."


def test_runtime_load_refusals_and_unload(server: str, adapters: dict[str, Path]) -> None:
    def load(name: str, path: Path, **extra: object) -> httpx.Response:
        return httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path),
                                                                  **extra}, timeout=60)

    ok = load("attn", adapters["attn"])
    assert (ok.status_code, ok.text) == (200, "Success: LoRA adapter 'attn' added successfully.")
    assert _complete(server, "attn").status_code == 200
    again = load("attn", adapters["attn"])
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    for name, status, words in (("dora", 400, "DoRA"), ("lm_head", 400, "lm_head"),
                                ("missing", 404, "No adapter found")):
        r = load(name, adapters[name])
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
        assert _complete(server, name).status_code == 404  # a refused adapter is not served
    bad = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "x"})
    assert bad.status_code == 400 and "Both 'lora_name' and 'lora_path'" in bad.json()["error"]["message"]
    gone = httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "attn"})
    assert (gone.status_code, gone.text) == (200, "Success: LoRA adapter 'attn' removed successfully.")
    assert _complete(server, "attn").status_code == 404
    twice = httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "attn"})
    assert twice.status_code == 404 and twice.json()["error"]["message"] == \
        "The lora adapter 'attn' cannot be found."
    assert _complete(server, "full").status_code == 200  # nothing else was affected


def test_telemetry_and_metrics(server: str) -> None:
    assert _complete(server, "full").status_code == 200
    lora = httpx.get(server + "/telemetry").json()["lora"]
    assert lora["max_lora"] == 2 and "full" in lora["device"] and "full" in lora["cpu"]
    assert lora["free_slots"] in (0, 1) and lora["load_seconds"]["full"] >= 0
    assert lora["reads"] >= 1 and lora["slot_fills"] >= 1  # at least "full"'s read and its copy into a slot
    for name, want in (("lbd:lora_reads_total", lora["reads"]),
                       ("lbd:lora_slot_fills_total", lora["slot_fills"])):
        assert settled(lambda n=name: metric_value(httpx.get(server + "/metrics").text, n), want) == want
    text = httpx.get(server + "/metrics").text
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in text
    assert 'lbd:lora_resident{' in text and 'lora_name="full"' in text and 'where="device"' in text
    assert "lbd:lora_free_slots{" in text and "lbd:lora_load_seconds{" in text


@pytest.mark.parametrize("flags,words", [
    (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "nopath"], "--lora-modules: 'nopath' is neither"),
    (["--enable-lora", "--lora-modules", '{"name": "a"}'], '--lora-modules: the JSON form needs'),
    (["--enable-lora", "--max-loras", "0"], "--max-loras must be a positive number"),
    (["--enable-lora", "--max-lora-rank", "12"], "--max-lora-rank must be one of"),
    (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "--max-cpu-loras (2) must be >="),
    (["--enable-lora", "--pipeline-parallel-size", "2"], "--enable-lora runs on one pipeline stage"),
])
def test_bad_flags_exit_2_naming_the_flag(flags: list[str], words: str,
                                          capsys: pytest.CaptureFixture) -> None:
    from lbd.engine.config.args import parse_engine_args

    with pytest.raises(SystemExit) as e:
        parse_engine_args(flags)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_load_unload_storm_breaks_nothing_else(server: str, tiny_llama: Path,
                                               adapters: dict[str, Path]) -> None:
    """Concurrent loads and unloads of one name, requests for it and for unknown adapters, beside base and
    "full" requests: no 5xx anywhere, every base/"full" request answered, no slot left to the storm."""
    import asyncio

    async def storm() -> list[tuple[str, int]]:
        async with httpx.AsyncClient(base_url=server, timeout=60) as c:
            async def complete(model: str) -> tuple[str, int]:
                r = await c.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 6,
                                                          "temperature": 0})
                return model, r.status_code

            async def cycle() -> tuple[str, int]:
                r = await c.post("/v1/load_lora_adapter", json={"lora_name": "storm",
                                                               "lora_path": str(adapters["attn"])})
                u = await c.post("/v1/unload_lora_adapter", json={"lora_name": "storm"})
                return "cycle", max(r.status_code, u.status_code)

            jobs = [complete(str(tiny_llama)) for _ in range(6)] + [complete("full") for _ in range(4)]
            jobs += [cycle() for _ in range(4)] + [complete("storm") for _ in range(4)] + [complete("ghost")]
            return await asyncio.gather(*jobs)

    results = asyncio.run(storm())
    assert all(status < 500 for _, status in results), results
    assert all(status == 200 for model, status in results if model in (str(tiny_llama), "full")), results
    assert dict(results)["ghost"] == 404
    httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "storm"})  # if a load won last
    deadline = time.monotonic() + 5  # /telemetry is the core's last stats: at most ~100 ms behind
    while True:
        lora = httpx.get(server + "/telemetry").json()["lora"]
        back = (lora["device"], lora["free_slots"]) == (["full"], 1) and "storm" not in lora["cpu"]
        if back or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    # two slots: "full" holds one, the other is free again; "storm" is gone everywhere
    assert back, (lora, results)


@pytest.mark.parametrize("value,served", [(None, False), ("0", False), ("1", True), ("True", True)])
def test_runtime_routes_only_behind_vllm_s_gate(value: str | None, served: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from aiohttp import web

    from lbd.engine.server.lora_routes import RUNTIME_ENV, add_lora_routes

    if value is None:
        monkeypatch.delenv(RUNTIME_ENV, raising=False)
    else:
        monkeypatch.setenv(RUNTIME_ENV, value)
    app = web.Application()
    add_lora_routes(app)
    paths = {r.canonical for r in app.router.resources()}
    assert ({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= paths) is served
    assert bool(paths) is served
