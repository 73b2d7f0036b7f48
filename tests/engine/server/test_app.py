"""The OpenAI HTTP server end to end: a real `python -m lbd.engine` on the tiny Llama, real HTTP clients."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from support import EngineServer, metric_value

MODEL = "tiny"
RANK = 1
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = start_server(tiny_llama, log, "--served-model-name", MODEL, "extra-name",
                       "--data-parallel-rank", str(RANK), "--data-parallel-size", "2",
                       "--max-request-body-bytes", "65536", "--max-logprobs", "5")
    try:
        yield srv
    finally:
        srv.close()


def start_server(model: Path, log: Path, *args: str) -> EngineServer:
    try:
        return EngineServer(model, "--kv-cache-memory-bytes", "32MiB", *args, log=log)
    except Exception as e:
        raise AssertionError(f"server failed to start: {e}\n{log.read_text(errors='replace')[-4000:]}") from e


@pytest.fixture(scope="module")
def client(server: EngineServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server: EngineServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def sse(lines: Iterator[str]) -> list[dict | str]:
    events: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else orjson.loads(data))
    return events


def assert_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["message"]
    if param != "any":
        assert err["param"] == param
    return err


def still_serves(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


# ---- small endpoints -----------------------------------------------------------------------------

def test_small_endpoints(http: httpx.Client, tiny_llama: Path) -> None:
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL, "extra-name"]
    assert models["data"][0]["max_model_len"] == 512 and models["data"][0]["root"] == str(tiny_llama)
    assert http.get("/health").status_code == 200
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    assert http.get("/version").json()["version"]
    assert http.get("/load").json() == {"server_load": 0}
    assert http.get("/health").headers["x-lbd-frontend-pid"].isdigit()


def test_tokenize_detokenize(http: httpx.Client, client: openai.OpenAI) -> None:
    r = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 512
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    msgs = chat("What is the capital of France?")
    counted = http.post("/tokenize", json={"messages": msgs}).json()["count"]
    out = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    assert out.usage.prompt_tokens == counted
    assert_error(http.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")
    assert_error(http.post("/tokenize", json={"prompt": 5}), 400, "prompt")


# ---- chat and completions ------------------------------------------------------------------------

def test_chat_non_stream_and_stream_agree(client: openai.OpenAI) -> None:
    msgs = chat("Hello, how are you today?")
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    choice = full.choices[0]
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-") and full.model == MODEL
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    assert again.choices[0].message.content == choice.message.content  # greedy is deterministic

    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_shapes(client: openai.OpenAI, http: httpx.Client) -> None:
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    text = out.choices[0].text
    assert out.usage.completion_tokens <= 10
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True) if c.choices)
    assert streamed == text
    echo = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0,
                                     echo=True)
    assert echo.choices[0].text == "Once upon a time" + text
    ids = http.post("/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == text


def test_batch_prompts_and_n(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=["one two", "three four"], max_tokens=5, n=2,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in out.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: n copies agree
    alone = client.completions.create(model=MODEL, prompt="three four", max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert by_index[2] == alone.choices[0].text
    assert out.usage.completion_tokens == 20
    chat_n = client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=4, n=3, seed=1,
                                            extra_body={"ignore_eos": True})
    assert [c.index for c in chat_n.choices] == [0, 1, 2] and chat_n.usage.completion_tokens == 12


def test_seed_reproducible(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 1.0,
          "seed": 1234}
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_logprobs_formats(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=chat("Hello"), max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)  # greedy = argmax
        assert entry.top_logprobs[0].bytes == entry.bytes and isinstance(entry.bytes, list)
    specials = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}  # ignore_eos: skipped in the text
    raw = b"".join(bytes(e.bytes) for e in content if e.token not in specials)
    assert raw.decode("utf-8", errors="replace") == out.choices[0].message.content

    comp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert max(top.values()) == pytest.approx(tlp, abs=1e-5) and tok in top


def test_stop_strings(client: openai.OpenAI, http: httpx.Client) -> None:
    kw = {"model": MODEL, "prompt": "Once upon a time there was", "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    base = client.completions.create(max_tokens=40, **kw).choices[0].text
    clean = [i for i in range(4, len(base) - 3) if "\ufffd" not in base[i:i + 3]]
    assert clean, f"no clean substring in {base!r}"
    stop = base[clean[0]:clean[0] + 3]
    expected = base[:base.find(stop)]
    before = http.get("/metrics").text
    gen_before = metric_value(before, "vllm:generation_tokens_total")
    stops_before = metric_value(before, "vllm:request_success_total", finished_reason="stop")
    out = client.completions.create(max_tokens=400, stop=[stop, "never-appears"], **kw)
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    assert choice.model_extra["stop_reason"] == stop
    assert out.usage.completion_tokens < 40
    text = wait_metrics(http, **{"vllm:num_requests_running": 0})
    # the front end aborted the core request at the stop string instead of letting it run to 400 tokens
    assert metric_value(text, "vllm:generation_tokens_total") - gen_before < 100
    # ... and it counts as finished by "stop", not as an abort. The core writes the counter and then the
    # gauge, but a scrape reads the multiprocess files one by one and can see the new gauge beside the old
    # counter, so the count is waited for rather than read once.
    deadline = time.monotonic() + 15
    stop_count = "vllm:request_success_total"
    while (stops := metric_value(text, stop_count, finished_reason="stop")) < stops_before + 1:
        assert time.monotonic() < deadline, f"the stop was never counted: {stops} after {stops_before}"
        time.sleep(0.1)
        text = http.get("/metrics").text
    assert stops == stops_before + 1
    streamed = list(client.completions.create(max_tokens=40, stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    extra = {"ignore_eos": True, "include_stop_str_in_output": True}
    kept = client.completions.create(max_tokens=40, stop=stop, **{**kw, "extra_body": extra})
    assert kept.choices[0].text == expected + stop


def test_stream_chunks_are_not_buffered(tiny_llama: Path, tmp_path: Path) -> None:
    """The first token reaches the client while the request still generates: nothing waits for the end. (On
    a sim rank, the same front end and core loop: its decode steps sleep ~6.5 ms each whatever the host's
    load, so the 400 tokens take seconds; the 2-layer model can write them all between two of a loaded
    client's reads, and a slower real model costs a checkpoint and a torch start-up.)"""
    srv = start_server(tiny_llama, tmp_path / "server.log", "--served-model-name", MODEL, "--device", "sim",
                       "--kv-cache-memory-bytes", "1GiB", "--max-model-len", "512")  # 8B-sized KV blocks
    body = {"model": MODEL, "prompt": "unbuffered", "stream": True, **LONG}
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c, c.stream("POST", "/v1/completions",
                                                                             json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert orjson.loads(first[6:])["choices"][0]["finish_reason"] is None
            assert c.get("/load").json() == {"server_load": 1}
            assert metric_value(c.get("/metrics").text, "vllm:num_requests_running") == 1
            events = [line for line in lines if line.startswith("data: ")]
    finally:
        srv.close()
    assert events[-1] == "data: [DONE]" and len(events) >= 100


def test_concurrent_requests_are_not_crossed(server: EngineServer) -> None:
    prompts = [f"Request number {i} says" + " hello" * i for i in range(8)]

    async def one(c: httpx.AsyncClient, p: str, stream: bool) -> str:
        body = {"model": MODEL, "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "stream": stream}
        if not stream:
            return (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        async with c.stream("POST", "/v1/completions", json=body) as r:
            events = [orjson.loads(line[6:]) async for line in r.aiter_lines()
                      if line.startswith("data: {")]
        return "".join(e["choices"][0]["text"] for e in events)

    async def run() -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            alone = [await one(c, p, False) for p in prompts]
            together = await asyncio.gather(*(one(c, p, i % 2 == 0) for i, p in enumerate(prompts)))
            return alone, list(together)

    alone, together = asyncio.run(run())
    assert together == alone


# ---- bad input -----------------------------------------------------------------------------------

def test_bad_inputs_each_get_an_openai_error(http: httpx.Client) -> None:
    cases = [
        (http.post("/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"}), 400, None),
        (http.post("/v1/completions", content=b""), 400, None),
        (http.post("/v1/chat/completions", json={"model": MODEL}), 400, "messages"),
        (http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat("x"), "max_tokens": "9"}),
         400, "max_tokens"),
        (http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": [1]}), 400,
         "temperature"),
        (http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 6}), 400, "logprobs"),
        (http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat("x"), "logprobs": True,
                                                  "top_logprobs": 6}), 400, "top_logprobs"),
        (http.post("/v1/completions", json={"model": "gpt-17", "prompt": "x"}), 404, "model"),
        (http.get("/v1/nothing-here"), 404, None),
        (http.get("/v1/completions"), 405, None),
    ]
    for r, status, param in cases:
        assert_error(r, status, param)
    assert cases[7][0].json()["error"]["type"] == "NotFoundError"
    assert "greater than max allowed: 5" in cases[5][0].json()["error"]["message"]
    still_serves(http)


def test_context_length_error_names_both_numbers(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 600})
    msg = assert_error(r, 400)["message"]
    assert "maximum context length is 512 tokens" in msg and "600 in the completion" in msg
    n = http.post("/tokenize", json={"prompt": "Hello"}).json()["count"]
    assert f"you requested {n + 600} tokens ({n} in the prompt" in msg
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat("word " * 600)})
    assert "input tokens" in assert_error(r, 400)["message"]
    still_serves(http)


def test_body_over_the_limit_gets_413(http: httpx.Client, server: EngineServer) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 70_000})
    assert "--max-request-body-bytes" in assert_error(r, 413)["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must hold for chunked bodies too
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(20):
            yield b"y" * 5000
        yield b'"}'

    assert_error(http.post("/v1/completions", content=chunks()), 413)
    still_serves(http)


def test_rank_header(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    r = http.post("/v1/completions", json=body, headers={"X-data-parallel-rank": str(RANK - 1)})
    assert "data parallel rank" in assert_error(r, 400)["message"]
    r = http.post("/v1/completions", json=body, headers={"X-data-parallel-rank": str(RANK)})
    assert r.status_code == 200, r.text


# ---- metrics, prefix cache, disconnects ----------------------------------------------------------

def test_metrics_carry_the_rank_label(http: httpx.Client) -> None:
    still_serves(http)
    text = http.get("/metrics").text
    label = {"engine": str(RANK), "model_name": MODEL}
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total"):
        assert metric_value(text, name, **label) > 0, name
    assert f'vllm:num_requests_running{{engine="{RANK}",model_name="{MODEL}"}}' in text
    assert 'engine="0"' not in text
    assert metric_value(text, "vllm:cache_config_info", block_size="16", engine=str(RANK)) == 1


def test_prefix_cache_hits_after_shared_prefix(http: httpx.Client) -> None:
    rng = random.Random(7)
    prefix = [rng.randrange(3, 380) for _ in range(64)]

    def hits() -> float:
        return metric_value(http.get("/metrics").text, "vllm:prefix_cache_hits_total")

    before = hits()
    for tail in ([5, 6, 7], [8, 9, 10, 11]):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": prefix + tail, "max_tokens": 2})
        assert r.status_code == 200, r.text
    assert hits() - before >= 48


def wait_metrics(http: httpx.Client, timeout: float = 15.0, **want: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = http.get("/metrics").text
        if all(metric_value(text, name) == value for name, value in want.items()):
            return text
        if time.monotonic() > deadline:
            got = {name: metric_value(text, name) for name in want}
            raise AssertionError(f"metrics never reached {want}: {got}")
        time.sleep(0.1)


def test_client_disconnects_abort_and_free_blocks(server: EngineServer, http: httpx.Client) -> None:
    idle = {"vllm:num_requests_running": 0, "vllm:kv_cache_usage_perc": 0}
    wait_metrics(http, **idle)
    gen_before = metric_value(http.get("/metrics").text, "vllm:generation_tokens_total")
    n = 4
    for i in range(n):  # streams: read the first event, then drop the connection
        with httpx.Client(base_url=server.base_url, timeout=30) as c, c.stream(
                "POST", "/v1/completions", json={"model": MODEL, "prompt": f"stream {i}", "stream": True,
                                                 **LONG}) as r:
            assert r.status_code == 200
            next(r.iter_lines())
    for i in range(n):  # non-streaming: give up 50 ms in, long before 400 tokens (a timeout on the answer
        # would depend on the machine's speed: the tiny model can produce 400 tokens in under 0.3 s)
        body = orjson.dumps({"model": MODEL, "prompt": f"plain {i}", **LONG})
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            time.sleep(0.05)
    text = wait_metrics(http, **idle)
    generated = metric_value(text, "vllm:generation_tokens_total") - gen_before
    assert generated < 2 * n * LONG["max_tokens"] / 2, generated  # aborted long before their 400 tokens
    assert http.get("/load").json() == {"server_load": 0}
    still_serves(http)


def test_half_sent_request_does_not_hurt(server: EngineServer, http: httpx.Client) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    still_serves(http)
