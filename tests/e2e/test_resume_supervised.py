"""Issue 41's acceptance 2 as a user deploys it: `lbd supervise` (a prefill rank and two decode ranks) behind
`lbd route`; the rank serving a stream is SIGKILLed mid-answer (its launcher, as a crash would take it), the
supervisor restarts it, and the client has exactly the unbroken run's answer: its text, one finish reason, one
``[DONE]``, its usage. For a chat with no ``max_tokens`` (it runs to the context), a greedy stream with
``frequency_penalty`` 1.0, a chat that ends by EOS, a JSON-schema chat (issue 45, acceptance 2: the client's
text parses against the schema, maxLength counted in characters), a ``tool_choice: "auto"`` chat read by the
``llama3_json`` parser (its call's arguments cut mid-way: the client's call is the unbroken run's), a P/D
stream (prefilled on rank 0, decoded on rank 1 or 2, moved to the other decode rank), and a completion under a
LoRA adapter every rank serves (issue 44, acceptance 1: resumed under the same adapter, the same greedy text).
tests/router/test_migration_exact.py covers the same and more over bare ranks with exact cuts; this file
shows it through the supervisor.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest

from support import settled
from support.lora import make_adapter
from support.node import ENGINE_FLAGS, SupervisorNode
from support.procs import free_port, spawn, stop, wait_http
from support.tiny import make_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BREAK_AT = 30  # chunks with text the client has when its rank is killed
MESSAGES = [{"role": "user", "content": "Count the numbers 0123456789 and add them."}]
# bounded, as real schemas are: random weights end it well past BREAK_AT tokens
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "temps", "sunny"],
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "temps": {"type": "array", "minItems": 16, "maxItems": 16,
                                   "items": {"type": "integer", "minimum": -40, "maximum": 50}},
                         "sunny": {"type": "boolean"}}}
# random weights write no calls of their own: under "auto" a regex (vLLM lets it stand beside "auto") makes
# them write a llama3_json call, which the ranks' parser (--tool-call-parser llama3_json) turns into one
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "temps": SCHEMA["properties"]["temps"]}}}}]
LLAMA3_CALL = (r'\{"name": "get_weather", "parameters": \{"city": "[a-z]{1,8}", '
               r'"temps": \[(-?[1-9]?[0-9], ){15}-?[1-9]?[0-9]\]\}\}')
LONG = " ".join(f"Guest {i} brought a lamp, a map and a bell to the house by the sea." for i in range(4))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SupervisorNode, str]]:
    folder = tmp_path_factory.mktemp("resume-supervised")
    # the model of tests/router/test_migration_exact.py: its greedy chat answer to MESSAGES ends by EOS
    model = make_tiny_llama(folder / "model", layers=8, hidden=512, heads=8, kv_heads=2, intermediate=2048,
                            max_pos=1024)
    adapter = make_adapter(folder / "adapter", model, rank=8, seed=44)
    at = ENGINE_FLAGS.index("--kv-cache-memory-bytes")
    flags = [*ENGINE_FLAGS[:at], "--kv-cache-memory-bytes", "64MiB", *ENGINE_FLAGS[at + 2:]]
    node = SupervisorNode(model, 3, "--prefill-ranks", "0", "--decode-ranks", "1,2", "--served-model-name",
                          "tiny", engine_flags=[*flags, "--enable-auto-tool-choice", "--tool-call-parser",
                                                "llama3_json", "--enable-lora", "--max-loras", "1",
                                                "--max-lora-rank", "8", "--lora-modules",
                                                f"adapted={adapter}"],
                          interval=0.3, timeout=1.0, threshold=2, log=folder / "node.log")
    port = free_port()
    router = spawn([sys.executable, "-m", "lbd", "route", "--host", "127.0.0.1", "--port", str(port),
                    "--upstreams", f"supervisor://127.0.0.1:{node.sport}", "--pd-disaggregation",
                    "--pd-min-prompt-tokens", "32",
                    "--debug-headers", "--kv-events", "off"], log=folder / "router.log")
    url = f"http://127.0.0.1:{port}"
    try:
        node.wait_ready(300)
        wait_http(url + "/health", timeout=60, proc=router)
        yield node, url
    finally:
        stop(router)
        node.close()


@pytest.fixture(autouse=True)
def every_rank_serving(deployment: tuple[SupervisorNode, str]) -> None:
    """All three ranks ready and routed (a killed one was restarted by the supervisor)."""
    node, url = deployment
    node.wait_ready(300)

    def routed() -> bool:
        eps = httpx.get(url + "/router/status", timeout=5).json()["endpoints"]
        return len(eps) == 3 and all(e["state"] == "ready" for e in eps)

    node.wait_for(routed, 60, "every rank routed")


def streamed(node: SupervisorNode, url: str, kind: str, kill: bool = False, **extra: Any) -> dict[str, Any]:
    """One greedy stream through the router; ``kill``: SIGKILL its rank's launcher at BREAK_AT text chunks."""
    req: dict[str, Any] = {"model": "tiny", "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}, **extra}
    if kind == "chat":
        req.setdefault("messages", MESSAGES)
    got: dict[str, Any] = {"text": "", "done": 0, "after_done": 0, "errors": [], "finishes": [],
                           "usage": None, "chunks": 0, "disagg": "", "calls": {}, "models": set()}
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    with httpx.stream("POST", url + path, json=req, timeout=300) as r:
        assert r.status_code == 200, r.read()
        got["disagg"] = r.headers.get("x-lbd-disagg", "")
        rank = int(r.headers["x-lbd-endpoint"].rsplit(":", 1)[1]) - node.base_port
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if got["done"]:
                got["after_done"] += 1
            if line == "data: [DONE]":
                got["done"] += 1
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                got["errors"].append(ev["error"]["message"])
                continue
            if ev.get("usage"):
                got["usage"] = ev["usage"]
            got["models"].add(ev.get("model"))
            for c in ev["choices"]:
                text = c["text"] if kind == "cmpl" else c["delta"].get("content") or ""
                got["text"] += text
                for d in [] if kind == "cmpl" else c["delta"].get("tool_calls") or []:
                    call = got["calls"].setdefault(d["index"], {"name": "", "arguments": "", "ids": 0})
                    call["name"] += d["function"].get("name") or ""
                    call["ids"] += "id" in d
                    text += d["function"].get("arguments") or ""
                    call["arguments"] += d["function"].get("arguments") or ""
                if c.get("finish_reason") is not None:
                    got["finishes"].append(c["finish_reason"])
                if text:
                    got["chunks"] += 1
                    if kill and got["chunks"] == BREAK_AT:
                        got["killed"] = rank
                        os.kill(node.rank(rank)["pid"], signal.SIGKILL)
    return got


def resumed(url: str) -> int:
    moves = httpx.get(url + "/router/status", timeout=5).json()["migrations"]["moves"]
    return sum(by.get("resumed", 0) for by in moves.values())


CASES = {
    "chat_no_max_tokens": ("chat", {"ignore_eos": True}),
    "frequency_penalty": ("cmpl", {"prompt": "def add(a, b): return a + b # numbers 0123456789",
                                   "max_tokens": 200, "frequency_penalty": 1.0}),
    "chat_ends_by_eos": ("chat", {}),
    "json_schema": ("chat", {"max_tokens": 300, "response_format": {  # compact: whitespace would run it long
        "type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}},
        "structured_outputs": {"disable_any_whitespace": True}}),
    "llama3_json_auto": ("chat", {"max_tokens": 300, "tools": TOOLS, "tool_choice": "auto",
                                  "structured_outputs": {"regex": LLAMA3_CALL}}),
    "pd_stream": ("cmpl", {"prompt": LONG, "max_tokens": 120, "ignore_eos": True}),
    "lora_adapter": ("cmpl", {"model": "adapted", "prompt": "The numbers 0123456789 and", "max_tokens": 120,
                              "ignore_eos": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_sigkilled_rank_leaves_the_client_the_unbroken_answer(deployment: tuple[SupervisorNode, str],
                                                                 case: str) -> None:
    node, url = deployment
    kind, extra = CASES[case]
    want = streamed(node, url, kind, **extra)
    assert not want["errors"] and want["done"] == 1 and len(want["finishes"]) == 1
    assert want["usage"]["completion_tokens"] > BREAK_AT + 8, want["usage"]
    if case == "chat_no_max_tokens":
        assert want["finishes"] == ["length"] and want["usage"]["total_tokens"] == 512
    if case in ("chat_ends_by_eos", "json_schema"):
        assert want["finishes"] == ["stop"]
    if case == "llama3_json_auto":  # one call (one id), its arguments the regex's, no content
        assert want["finishes"] == ["tool_calls"] and want["text"] == "" and list(want["calls"]) == [0]
        assert want["calls"][0]["name"] == "get_weather" and want["calls"][0]["ids"] == 1
    if case == "pd_stream":
        assert want["disagg"].startswith("pd "), want["disagg"]
    if case == "lora_adapter":  # under the adapter: its name on every chunk, another text than the base's
        assert want["models"] == {"adapted"}
        assert streamed(node, url, kind, **{**extra, "model": "tiny"})["text"] != want["text"]
    before = resumed(url)
    got = streamed(node, url, kind, kill=True, **extra)
    assert got.get("killed") in (1, 2), got  # a decode rank served it, and was killed
    assert settled(lambda: resumed(url), before + 1) == before + 1
    assert not got["errors"], got["errors"]
    assert got["text"] == want["text"]
    assert got["finishes"] == want["finishes"]
    assert got["done"] == 1 and got["after_done"] == 0
    assert got["usage"] == want["usage"]
    assert got["calls"] == want["calls"]  # announced once (one id), the same name and arguments
    assert got["models"] == want["models"]  # a resumed adapter stream stays under its adapter
    if case == "json_schema":  # whole UTF-8 characters (structured.utf8): maxLength holds, client-counted
        assert "\ufffd" not in got["text"]
        jsonschema.validate(json.loads(got["text"], strict=False), SCHEMA)
