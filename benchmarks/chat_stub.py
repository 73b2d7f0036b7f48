"""The 2,000-token chat case of benchmarks/router_overhead_chat.py: bodies, and what a stub engine adds to
answer like an lbd engine with KV events (its tokenizer, /kv_event_sources, and a real publisher that has
announced the system prompt's blocks), so `lbd route` does its whole per-request job: render the chat
template, tokenize the new turn (the system prompt's pieces are cached after the first request), walk the
block chain over the exact index, track the pending blocks, and add its token ids to the body (the stub's
/tokenizer_info says it takes them, as lbd's engine does; the stub ignores them).

Every request is one more turn: the same 2,000-token system prompt and a user message of its own (a counter),
as in multi-turn chat. The cold case (``cold=True``) puts the counter at the start of the system prompt
instead: every request is a new 2,000-token prompt that no engine holds (the router's cold path, ``kv.cold``).
The stub process runs the engine's ZmqEventPublisher, so the router subscribes and replays for real; its
block hashes are arbitrary (the router keys blocks by its own chain over token ids).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

SYSTEM_TOKENS = 2000
_WORDS = ("ocean river lake coast tide current reef harbor island delta estuary wave storm salt fish "
          "whale coral kelp shell sand rock cliff bay gulf strait channel lagoon marsh shore").split()


def prepare(model_dir: str, out: Path) -> dict[str, Any]:
    """Write the fixture (bodies, tokenizer files, the announced blocks) to ``out``; returns it."""
    from lbd.router.kv.tokenize import load_local

    tok = load_local(model_dir)
    rng = random.Random(0)
    words: list[str] = []
    while len(tok.rust.encode(" ".join(words)).ids) < SYSTEM_TOKENS:
        words += [rng.choice(_WORDS) for _ in range(50)]
    system = " ".join(words)
    prefix = json.dumps({"model": "stub-model", "max_tokens": 1, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "@@"}]}).split("@@")
    cold = json.dumps({"model": "stub-model", "max_tokens": 1, "messages": [
        {"role": "system", "content": "@@ " + system}, {"role": "user", "content": "question"}]}).split("@@")
    ids_a = _ids(tok, system, "question 1")
    ids_b = _ids(tok, system, "question 2")
    shared = next((i for i, (a, b) in enumerate(zip(ids_a, ids_b, strict=False)) if a != b), len(ids_a))
    blocks = shared // 16
    tokenizer_json = Path(model_dir, "tokenizer.json").read_text()
    info = {"chat_template": tok.template_source, **tok.template_vars,
            "tokenizer_json_sha256": hashlib.sha256(tokenizer_json.encode()).hexdigest()}
    # as lbd's engine does: take the router's token ids (the stub ignores them; the router pays the splice)
    fingerprint = hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()
    info["prompt_token_ids"] = {"field": "lbd_prompt_token_ids", "fingerprint": fingerprint}
    fixture = {"body_prefix": prefix[0] + "question ", "body_suffix": prefix[1], "prompt_tokens": len(ids_a),
               "cold_prefix": cold[0] + "Prompt ", "cold_suffix": cold[1],
               "block_tokens": ids_a[: blocks * 16], "tokenizer_info": info}
    out.write_text(json.dumps(fixture))
    (out.parent / "tokenizer.json").write_text(tokenizer_json)
    return fixture


def _ids(tok: Any, system: str, user: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    plan = tok.plan_request({"messages": messages})
    tok.fill(plan, tok.encode_missing(plan))
    return tok.assemble(plan)


def body(fixture: dict[str, Any], n: int | str, cold: bool = False) -> bytes:
    kind = "cold" if cold else "body"
    return f"{fixture[kind + '_prefix']}{n}{fixture[kind + '_suffix']}".encode()


def wrk_script(fixture: dict[str, Any], path: Path, cold: bool = False) -> Path:
    """A wrk script that sends each request with its own user turn (cold: its own system prompt).

    Each wrk thread runs its own Lua state, and every run starts the script afresh: a bare counter would
    send thread 2 the prompts of thread 1 and each run the prompts of the one before (cache hits in what
    is meant to be new text). So each thread tags its prompts with the clock's second and its number (runs
    last a second at least, so no two share a second)."""
    kind = "cold" if cold else "body"
    path.write_text(
        "local threads = 0\n"
        "setup = function(thread)\n  threads = threads + 1\n  thread:set('tid', threads)\nend\n"
        "init = function(args)\n  counter = 0\n  tag = os.time() .. '.' .. tid .. '.'\nend\n"
        f"prefix = [==[{fixture[kind + '_prefix']}]==]\nsuffix = [==[{fixture[kind + '_suffix']}]==]\n"
        "request = function()\n  counter = counter + 1\n"
        '  return wrk.format("POST", "/v1/chat/completions", {["Content-Type"] = "application/json"}, '
        "prefix .. tag .. counter .. suffix)\nend\n"
    )
    return path


def stub_answers(fixture_path: str, http: Any) -> tuple[dict[bytes, bytes], Any]:
    """The extra answers of a chat stub, and its publisher (kept alive by the caller)."""
    from lbd.engine.config.kv_events import KVEventsConfig
    from lbd.engine.kv_events.publisher import ZmqEventPublisher
    from lbd.wire.kv_events import BlockStored

    fixture = json.loads(Path(fixture_path).read_text())
    cfg = KVEventsConfig(True, "zmq", "tcp://*:0", "tcp://*:0")
    pub = ZmqEventPublisher(cfg, 0, "127.0.0.1")
    toks = fixture["block_tokens"]
    pub.publish([BlockStored(block_hashes=list(range(1, len(toks) // 16 + 1)), parent_block_hash=None,
                             token_ids=toks, block_size=16, lora_id=None, medium="GPU", lora_name=None)])
    sources = json.dumps({"0": pub.advertised()}).encode()
    tokenizer = Path(fixture_path).parent.joinpath("tokenizer.json").read_bytes()
    answers = {
        b"/kv_event_sources": http(b"200 OK", sources),
        b"/tokenizer_info": http(b"200 OK", json.dumps(fixture["tokenizer_info"]).encode()),
        b"/tokenizer.json": http(b"200 OK", tokenizer),
    }
    return answers, pub
