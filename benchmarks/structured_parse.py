"""Issue 45's first checks against `lbd serve` with the default model, N times each: the openai SDK's
``chat.completions.parse`` with a pydantic model (bounded string and list fields, as real schemas are), and
streamed tool calls with ``tool_choice="required"`` (every call of a declared tool, its arguments valid
against the tool's schema), ``tool_choice="auto"`` read by the ``hermes`` parser (the server runs with
``--enable-auto-tool-choice --tool-call-parser hermes``; SmolLM2's template does not render ``tools``, so a
system message states them in Hermes' words with one worked example: how many answers the model wrote calls
in, and that each became ``tool_calls`` with no markup left in the content) and a bad schema (a 400 naming
it); prints each answer's time and finish reason, how many passed, and the mask's
cost at one and 32 rows (xgrammar's CPU kernel on the default model's vocabulary). ``--through-router``
asks the same of ``lbd serve --data-parallel-size 2`` (two engine ranks behind ``lbd route``) and prints the
router's request and decision counters (its /metrics): every answer went through it.

    .venv/bin/python benchmarks/structured_parse.py                 # starts `python -m lbd.engine`
    .venv/bin/python benchmarks/structured_parse.py --through-router --n 20
    .venv/bin/python benchmarks/structured_parse.py --url http://127.0.0.1:8000 --n 20
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from typing import Annotated

import httpx
import jsonschema
import openai
import orjson
from pydantic import BaseModel, Field

Short = Annotated[str, Field(max_length=40)]
CITIES = ["Paris", "Tokyo", "Lima", "Cairo", "Oslo", "Hanoi", "Quito", "Perth", "Seoul", "Dakar"]


class City(BaseModel):
    name: Short
    country: Short
    population_millions: float
    landmarks: Annotated[list[Short], Field(max_length=3)]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 40}},
                   "required": ["zone"]}}}
MODEL = "SmolLM2-135M-Instruct"
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def streamed_calls(client: openai.OpenAI, i: int) -> tuple[list[tuple[str, str]], str | None]:
    """(name, arguments) of each call of a streamed tool_choice="required" answer, and its finish reason."""
    question = f"What is the weather in {CITIES[i % len(CITIES)]} for the next {1 + i % 7} days?"
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}],
        tools=[WEATHER, TIME], tool_choice="required", stream=True, max_tokens=300, temperature=0.7, seed=i)
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, [d.function.name or "", ""])
                call[1] += d.function.arguments or ""
    return [(name, args) for name, args in calls.values()], finish


def valid_calls(calls: list[tuple[str, str]]) -> bool:
    try:
        for name, arguments in calls:
            jsonschema.validate(orjson.loads(arguments), SCHEMAS[name])
    except (KeyError, orjson.JSONDecodeError, jsonschema.ValidationError):
        return False
    return bool(calls)


def run_tools(client: openai.OpenAI, n: int) -> None:
    good = 0
    for i in range(n):
        t0 = time.perf_counter()
        calls, finish = streamed_calls(client, i)
        ok = valid_calls(calls)
        good += ok
        print(f"{i:3d} {time.perf_counter() - t0:6.2f} s {finish or '-':10s} {'valid' if ok else 'INVALID'} "
              f"{[name for name, _ in calls]}")
    print(f"streamed tool calls valid {good} of {n}")


HERMES_SYSTEM = (
    "You are a function calling AI model. You may call one or more functions to assist with the user query. "
    f"Here are the available tools: <tools>{orjson.dumps([WEATHER, TIME]).decode()}</tools> "
    "For each function call return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
EXAMPLE = [{"role": "user", "content": "What is the weather in Rome for the next 2 days?"},
           {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                            '{"city": "Rome", "days": 2}}\n</tool_call>'}]


def run_auto(client: openai.OpenAI, n: int) -> None:
    """``tool_choice="auto"`` answers: calls where the model wrote hermes markup, and no markup left over."""
    called = valid = leftover = 0
    for i in range(n):
        question = f"What is the weather in {CITIES[i % len(CITIES)]} for the next {1 + i % 7} days?"
        messages = [{"role": "system", "content": HERMES_SYSTEM}, *EXAMPLE,
                    {"role": "user", "content": question}]
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                           tool_choice="auto", max_tokens=120, temperature=0.7, seed=i)
        msg = r.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
        ok = valid_calls(calls)
        called += bool(calls)
        valid += ok
        leftover += "<tool_call>" in (msg.content or "")
        what = ("calls valid" if ok else "calls INVALID") if calls else "text"
        print(f"{i:3d} {r.choices[0].finish_reason:10s} {what} "
              f"{[name for name, _ in calls] or repr((msg.content or '')[:60])}")
    print(f"auto (hermes): calls in {called} of {n} answers ({valid} calling only declared tools with valid "
          f"arguments); tool markup left in the content of {leftover}")


def bad_schema(client: openai.OpenAI) -> None:
    try:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}})
        print("bad schema: ACCEPTED (no 400)")
    except openai.BadRequestError as e:
        print(f"bad schema: {e.status_code} {e.body.get('message') if isinstance(e.body, dict) else e.body}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(through_router: bool) -> tuple[subprocess.Popen, str]:
    """`python -m lbd.engine`, or `lbd serve --data-parallel-size 2` (the router in front of two ranks);
    ready once a chat answer comes back (the router's /health may answer before its ranks do)."""
    port, health = free_port(), free_port()
    where = ["--host", "127.0.0.1", "--port", str(port), "--enable-auto-tool-choice", "--tool-call-parser",
             "hermes"]
    # a free health port: the default (9256) is taken by any other `lbd serve` on the host
    argv = ([sys.executable, "-m", "lbd", "serve", "--data-parallel-size", "2", *where,
             "--data-parallel-supervisor-port", str(health)] if through_router
            else [sys.executable, "-m", "lbd.engine", *where])
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"{argv[2:4]} did not start")


def router_counters(url: str) -> str:
    """The router's answered-request and routing-decision counters (proof the answers went through it)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError as e:
        return f"(no /metrics: {e})"
    lines = [ln for ln in text.splitlines()
             if ln.startswith(("lbd_router_requests_total", "lbd_router_decisions_total"))]
    return "; ".join(lines[:8]) or "(no lbd_router_ counters in /metrics)"


def mask_cost_ms(rows: int, vocab: int = 49152, repeat: int = 30) -> float:
    import torch
    import xgrammar

    logits = torch.randn(rows, vocab)
    bitmask = torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)
    bitmask[:, ::3] = 0
    xgrammar.apply_token_bitmask_inplace(logits, bitmask)
    t0 = time.perf_counter()
    for _ in range(repeat):
        xgrammar.apply_token_bitmask_inplace(logits, bitmask)
    return (time.perf_counter() - t0) / repeat * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="an engine already serving the default model")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--through-router", action="store_true",
                    help="start `lbd serve --data-parallel-size 2` (lbd route over two ranks) instead")
    args = ap.parse_args()
    proc, url = (None, args.url) if args.url else start_engine(args.through_router)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        parsed = 0
        for i in range(args.n):
            t0 = time.perf_counter()
            r = client.chat.completions.parse(
                model=MODEL, response_format=City, max_tokens=300, temperature=0.7, seed=i,
                messages=[{"role": "user", "content": f"Describe {CITIES[i % len(CITIES)]} as JSON."}])
            ok = isinstance(r.choices[0].message.parsed, City)
            parsed += ok
            print(f"{i:3d} {time.perf_counter() - t0:6.2f} s {r.choices[0].finish_reason:6s} "
                  f"{'parsed' if ok else 'NOT PARSED'} {r.usage.completion_tokens} tokens")
        print(f"parsed {parsed} of {args.n}")
        run_tools(client, args.n)
        run_auto(client, args.n)
        bad_schema(client)
        if args.through_router:
            print(f"router counters: {router_counters(url)}")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print(f"token mask (xgrammar CPU kernel, vocab 49152): {mask_cost_ms(1):.2f} ms at 1 row, "
          f"{mask_cost_ms(32):.2f} ms at 32 rows")


if __name__ == "__main__":
    main()
