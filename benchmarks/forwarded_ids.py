"""Time to first token of chat turns with the router's token ids forwarded to the rank (issue 13).

One `--device sim` rank (the real front end, scheduler and prefix cache; the h100-llama3-8b timing model at
time scale 1, so a turn's prefill takes what it would on an H100), and in front of it: nothing (direct),
`lbd route` (exact view, ids forwarded: the rank skips its chat template and tokenizer), `lbd route
--no-forward-prompt-ids` (the rank renders and tokenizes the whole history again) and sglang-router
(cache_aware; it forwards the text) when installed. Every target keeps its own conversation: a system prompt
of --words words and turns of ~30-word questions and ~20-word answers, so each request is the cached history
plus one new turn (at --max-history messages a new conversation starts under the same system prompt). Requests
go one at a time, the targets in a new random order each round, streamed, max_tokens 1; TTFT is the client's
(first content or finish chunk). Prints medians, each target's TTFT minus direct's, and lbd's ratio to each
other target, per history size.

    .venv/bin/python benchmarks/forwarded_ids.py [--rounds 40] [--words 900,3000] [--json F]
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test-support helpers
from lbd.common.internal_key import INTERNAL_KEY_ENV  # noqa: E402
from peers import lbd_route_argv, peer_argv, peer_installed  # noqa: E402
from support.procs import exit_on_sigterm, free_port, spawn, stop, wait_http  # noqa: E402

KV_EVENTS = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}'


def words_of(tokenizer_json: str) -> list[str]:
    """Lower-case whole-word tokens of the rank's own vocabulary: text that tokenizes like prose."""
    vocab = orjson.loads(tokenizer_json)["model"]["vocab"]
    return [t[1:] for t in vocab
            if t.startswith("\u0120") and t[1:].isalpha() and t[1:].islower() and len(t) > 3]


class Conversation:
    def __init__(self, rng: random.Random, words: list[str], system_words: int, max_history: int) -> None:
        self.rng, self.words, self.max_history = rng, words, max_history
        self.messages = [{"role": "system", "content": self.text(system_words)}]

    def text(self, n: int) -> str:
        return " ".join(self.rng.choice(self.words) for _ in range(n))

    def next_body(self, model: str) -> dict:
        if len(self.messages) >= self.max_history:
            del self.messages[1:]  # a new conversation under the same (cached) system prompt
        self.messages.append({"role": "user", "content": self.text(30) + "?"})
        body = {"model": model, "messages": list(self.messages), "max_tokens": 1, "stream": True}
        self.messages.append({"role": "assistant", "content": self.text(20)})
        return body


def ttft_ms(c: httpx.Client, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            choice = (orjson.loads(line[5:]).get("choices") or [{}])[0]
            if (choice.get("delta") or {}).get("content") or choice.get("finish_reason"):
                return (time.perf_counter() - t0) * 1e3
    raise RuntimeError(f"{url}: the stream ended without a token")


def run(args: argparse.Namespace, logs: Path) -> dict:
    port = free_port()
    key = {INTERNAL_KEY_ENV: secrets.token_hex(32)}  # the rank takes ids signed with it
    rank = spawn([sys.executable, "-m", "lbd", "serve", "--device", "sim", "--sim-profile", "h100-llama3-8b",
                  "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                  "--disable-log-requests", "--kv-events-config", KV_EVENTS], env=key, log=logs / "rank.log")
    procs = [rank]
    try:
        direct = f"http://127.0.0.1:{port}"
        wait_http(direct + "/health", timeout=300, proc=rank)
        targets = {"direct": direct}
        routers = [("lbd", ()), ("lbd, ids not forwarded", ("--no-forward-prompt-ids",))]
        for name, extra in routers:
            p = free_port()
            argv, ready = lbd_route_argv(p, direct, *extra)
            procs.append(spawn(argv, env=key, log=logs / f"{name.split(',')[0]}-{len(procs)}.log"))
            wait_http(f"http://127.0.0.1:{p}{ready}", timeout=60, proc=procs[-1])
            targets[name] = f"http://127.0.0.1:{p}"
        if peer_installed("sglang-router"):
            p = free_port()
            argv, ready = peer_argv("sglang-router", p, [direct], "cache_aware")
            procs.append(spawn(argv, log=logs / "sglang-router.log"))
            wait_http(f"http://127.0.0.1:{p}{ready}", timeout=60, proc=procs[-1])
            targets["sglang-router"] = f"http://127.0.0.1:{p}"
        else:
            print("sglang-router not installed (bash scripts/setup-peers.sh): left out")
        time.sleep(2.0)  # lbd's views: event sources and tokenizer learned
        model = httpx.get(direct + "/v1/models").json()["data"][0]["id"]
        words = words_of(httpx.get(direct + "/tokenizer.json").text)
        rng = random.Random(args.seed)
        out: dict = {}
        with httpx.Client(timeout=120) as c:
            for n_words in args.words:
                convs = {t: Conversation(rng, words, n_words, args.max_history) for t in targets}
                for t, url in targets.items():  # the system prompt's cold prefill, not measured
                    ttft_ms(c, url, convs[t].next_body(model))
                times: dict[str, list[float]] = {t: [] for t in targets}
                tokens = 0
                for _ in range(args.rounds):
                    order = list(targets)
                    rng.shuffle(order)
                    for t in order:
                        body = convs[t].next_body(model)
                        times[t].append(ttft_ms(c, targets[t], body))
                        if t == "direct":
                            tokens = httpx.post(direct + "/tokenize", json={"model": model,
                                                                            "messages": body["messages"]}
                                                ).json()["count"]
                out[str(n_words)] = {"prompt_tokens_last": tokens,
                                     "ttft_ms": {t: statistics.median(v) for t, v in times.items()},
                                     "samples": times}
        return out
    finally:
        for p in procs:
            stop(p)


def report(out: dict) -> None:
    for n_words, row in out.items():
        med = row["ttft_ms"]
        base = med["direct"]
        print(f"\n### system prompt of {n_words} words (last request: {row['prompt_tokens_last']} prompt "
              "tokens)\n")
        print("| target | TTFT p50 ms | minus direct ms | lbd / target |")
        print("|---|---:|---:|---:|")
        for t, m in med.items():
            ratio = "" if t == "lbd" else f"{med['lbd'] / m:.2f}"
            print(f"| {t} | {m:.2f} | {m - base:+.2f} | {ratio} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--words", default="900,3000", help="system prompt sizes (words), comma-separated")
    p.add_argument("--max-history", type=int, default=24, help="messages before a new conversation starts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    try:
        args.words = [int(w) for w in args.words.split(",")]
    except ValueError:
        p.error("--words takes comma-separated integers, e.g. 900,3000")
    exit_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="forwarded-ids-") as d:
        out = run(args, Path(d))
    report(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
