"""A benchmark stand-in for a fleet of engine ranks, all in one process: hundreds of ranks fit on this
machine, where hundreds of ``lbd.engine --device sim`` processes would not. Not an engine and not a cluster:
it exists so the router can be measured and tested at fleet scale (``benchmarks/fleet_scale.py``,
``tests/router/test_pushed_telemetry.py``).

    python tests/support/fleet_standin.py --ranks 64 --base-port 21000 --control-port 20999 [--no-push]

Each rank has its own HTTP port (base port + i) serving what a router reads of an lbd rank: /health,
/v1/models, /metrics (vLLM's names, advertising /telemetry), /telemetry (with its ``load_stream``), and
/v1/completions and /v1/chat/completions (streamed or not). Unless ``--no-push``, each rank publishes its load
on its own ZMQ PUB socket in the documented wire format (``lbd.wire.load_state``): on change (at most every
20 ms) and every ``--heartbeat-s``; ``--curve`` makes each a CURVE server keyed by ``$LBD_CLUSTER_TOKEN``.

Answers take the time a sim profile gives (``lbd.engine.sim_profiles``): each rank runs continuous batching
over its requests, one step at a time, prefill of the uncached prompt tokens then one token per step. The
prefix cache is a per-rank LRU of prompt blocks (16 words each, chained hashes), so prefix hits depend on
routing.

The control port scripts the test sequences: ``POST /standin/{rank}/{action}`` with ``set`` (JSON running,
waiting, kv_usage: overrides the model's numbers), ``pause`` / ``resume`` (publishing), ``skip`` (drop the
next message: subscribers see a gap), ``restart`` (a new instance: seq from 0, counters and cache cleared),
``forge`` (JSON ``as``: on this rank's socket, a message naming that rank's instance, stream and DP rank,
``running`` 999 unless given); ``GET /standin/stats`` totals every rank's counters.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import json
import os
import random
import secrets
import sys
import time

import zmq
from aiohttp import web

from lbd.common.cluster import CLUSTER_TOKEN_ENV, secure_zmq_server
from lbd.engine.sim_profiles import StepShape, get_profile
from lbd.wire.load_state import PURPOSE, TOPIC, LoadState, encode_state

MODEL = "standin-model"
BLOCK_WORDS = 16
MIN_INTERVAL_S = 0.02


class Req:
    __slots__ = ("prompt_tokens", "cached", "max_tokens", "done_tokens", "prefilled", "future")

    def __init__(self, prompt_tokens: int, cached: int, max_tokens: int) -> None:
        self.prompt_tokens, self.cached, self.max_tokens = prompt_tokens, cached, max_tokens
        self.done_tokens, self.prefilled = 0, False
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class Rank:
    def __init__(self, index: int, port: int, fleet: Fleet) -> None:
        self.index, self.port, self.fleet = index, port, fleet
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.cache: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.override: dict[str, float] = {}
        self.paused = False
        self.skip = 0
        self.stepping = False
        self.pub: zmq.Socket | None = None
        self.stream = ""
        self._pending: asyncio.TimerHandle | None = None
        self._last_key: tuple | None = None
        self.last_sent = 0.0
        self.reset()

    def reset(self) -> None:
        self.instance, self.seq = secrets.token_hex(8), 0
        self.prefix_queries = self.prefix_hits = self.prompt_tokens = self.generation_tokens = 0
        self.cache.clear()

    # ---- numbers ---------------------------------------------------------------------------------------
    def numbers(self) -> tuple[int, int, float]:
        o = self.override
        used = sum(r.prompt_tokens + r.done_tokens for r in self.running) / BLOCK_WORDS
        kv = min(1.0, used / self.fleet.num_blocks)
        return (int(o.get("running", len(self.running))), int(o.get("waiting", len(self.waiting))),
                float(o.get("kv_usage", kv)))

    def state(self) -> LoadState:
        running, waiting, kv = self.numbers()
        return LoadState(self.instance, self.seq, time.time(), self.index, running, waiting, kv,
                         self.fleet.num_blocks, BLOCK_WORDS, self.prefix_queries, self.prefix_hits,
                         self.prompt_tokens, self.generation_tokens, self.fleet.heartbeat_s, self.stream)

    def telemetry(self) -> dict[str, object]:
        running, waiting, kv = self.numbers()
        stream = None
        if self.pub is not None:
            stream = {"endpoint": self.stream, "instance": self.instance, "topic": TOPIC.decode(),
                      "heartbeat_s": self.fleet.heartbeat_s, "curve": self.fleet.ns.curve}
        return {"engine": self.index, "model_names": [MODEL], "num_requests_running": running,
                "num_requests_waiting": waiting, "kv_cache_usage_perc": kv, "block_size": BLOCK_WORDS,
                "num_gpu_blocks": self.fleet.num_blocks, "prefix_cache_queries_total": self.prefix_queries,
                "prefix_cache_hits_total": self.prefix_hits, "prompt_tokens_total": self.prompt_tokens,
                "generation_tokens_total": self.generation_tokens, "load_stream": stream}

    def metrics(self) -> str:
        running, waiting, kv = self.numbers()
        lab = f'engine="{self.index}",model_name="{MODEL}"'
        return "".join(f"vllm:{name}{{{lab}}} {value}\n" for name, value in (
            ("num_requests_running", running), ("num_requests_waiting", waiting),
            ("kv_cache_usage_perc", kv), ("prefix_cache_queries_total", self.prefix_queries),
            ("prefix_cache_hits_total", self.prefix_hits), ("prompt_tokens_total", self.prompt_tokens),
            ("generation_tokens_total", self.generation_tokens)))

    # ---- publishing ------------------------------------------------------------------------------------
    def changed(self) -> None:
        if self.pub is None or self._pending is not None:
            return
        if self.numbers() == self._last_key:
            return
        wait = self.last_sent + MIN_INTERVAL_S - time.monotonic()
        if wait <= 0:
            self.send()
        else:
            self._pending = asyncio.get_running_loop().call_later(wait, self.send)

    def send(self) -> None:
        self._pending = None
        if self.pub is None or self.paused:
            return
        msg = self.state()
        self.seq += 1
        self._last_key, self.last_sent = self.numbers(), time.monotonic()
        if self.skip:
            self.skip -= 1
            return
        try:
            self.pub.send_multipart((TOPIC, encode_state(msg)), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    # ---- serving ---------------------------------------------------------------------------------------
    def blocks(self, text: str) -> list[bytes]:
        words = text.split()
        out, h = [], b""
        for i in range(len(words) // BLOCK_WORDS):
            h = hashlib.blake2b(h + " ".join(words[i * BLOCK_WORDS:(i + 1) * BLOCK_WORDS]).encode(),
                                digest_size=8).digest()
            out.append(h)
        return out

    async def serve(self, text: str, max_tokens: int) -> int:
        blocks = self.blocks(text)
        prompt = max(1, len(text.split()))
        hit = 0
        for b in blocks:
            if b not in self.cache:
                break
            self.cache.move_to_end(b)
            hit += 1
        for b in blocks[hit:]:
            self.cache[b] = None
        while len(self.cache) > self.fleet.num_blocks:
            self.cache.popitem(last=False)
        cached = hit * BLOCK_WORDS
        self.prefix_queries += prompt
        self.prefix_hits += cached
        self.prompt_tokens += prompt
        req = Req(prompt, cached, max(1, max_tokens))
        self.waiting.append(req)
        self.changed()
        if not self.stepping:
            self.stepping = True
            asyncio.ensure_future(self.steps())
        await req.future
        return cached

    async def steps(self) -> None:
        prof = self.fleet.profile
        try:
            while self.waiting or self.running:
                while self.waiting and len(self.running) < 256:
                    self.running.append(self.waiting.popleft())
                fresh = [r for r in self.running if not r.prefilled]
                prefill = sum(r.prompt_tokens - r.cached for r in fresh)
                shape = StepShape(prefill_tokens=prefill, prefill_seqs=len(fresh),
                                  decode_seqs=len(self.running) - len(fresh),
                                  kv_tokens_read=sum(r.prompt_tokens + r.done_tokens for r in self.running),
                                  attn_pairs=sum((r.prompt_tokens - r.cached) * r.prompt_tokens
                                                 for r in fresh))
                await asyncio.sleep(prof.step_time(shape))
                for r in self.running:
                    r.prefilled = True
                    r.done_tokens += 1
                    self.generation_tokens += 1
                done = [r for r in self.running if r.done_tokens >= r.max_tokens]
                if done:
                    self.running = [r for r in self.running if r.done_tokens < r.max_tokens]
                    for r in done:
                        r.future.set_result(None)
                self.changed()
        finally:
            self.stepping = False


class Fleet:
    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.heartbeat_s = ns.heartbeat_s
        self.profile = get_profile(ns.sim_profile).scaled(ns.time_scale)
        self.num_blocks = ns.num_blocks
        self.ctx = zmq.Context(io_threads=1)
        self.ranks = [Rank(i, ns.base_port + i, self) for i in range(ns.ranks)]

    async def start(self) -> None:
        for rank in self.ranks:
            if not self.ns.no_push:
                rank.pub = self.ctx.socket(zmq.PUB)
                rank.pub.setsockopt(zmq.LINGER, 0)
                if self.ns.curve:  # as a rank serving beyond loopback with the cluster token set
                    secure_zmq_server(rank.pub, os.environ[CLUSTER_TOKEN_ENV], PURPOSE)
                port = rank.pub.bind_to_random_port("tcp://127.0.0.1")
                rank.stream = f"tcp://127.0.0.1:{port}"
            rank.last_sent = time.monotonic() - random.random() * self.heartbeat_s  # independent phases
            runner = web.AppRunner(rank_app(rank), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", rank.port, backlog=1024).start()
        control = web.AppRunner(control_app(self), access_log=None)
        await control.setup()
        await web.TCPSite(control, "127.0.0.1", self.ns.control_port).start()
        if not self.ns.no_push:
            asyncio.ensure_future(self.heartbeats())

    async def heartbeats(self) -> None:
        """Every rank at least every heartbeat: a sweep every quarter heartbeat sends to the ranks due."""
        while True:
            await asyncio.sleep(self.heartbeat_s / 4)
            now = time.monotonic()
            for rank in self.ranks:
                if now - rank.last_sent >= self.heartbeat_s:
                    rank.send()


def _text(body: dict) -> str:
    if isinstance(body.get("prompt"), str):
        return body["prompt"]
    msgs = body.get("messages") or []
    return " ".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))


def rank_app(rank: Rank) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens")
                         or rank.fleet.ns.default_max_tokens)
        chat = request.path.endswith("chat/completions")
        cached = await rank.serve(_text(body), max_tokens)
        usage = {"prompt_tokens": len(_text(body).split()), "completion_tokens": max_tokens,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        obj = "chat.completion" if chat else "text_completion"
        choice = ({"index": 0, "message": {"role": "assistant", "content": "ok " * max_tokens},
                   "finish_reason": "length"} if chat else
                  {"index": 0, "text": "ok " * max_tokens, "finish_reason": "length"})
        out = {"id": f"standin-{rank.index}", "object": obj, "model": MODEL, "choices": [choice],
               "usage": usage, "standin_rank": rank.index}
        if not body.get("stream"):
            return web.json_response(out)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if chat:
            choice = {"index": 0, "delta": choice["message"], "finish_reason": "length"}
        out.update(object=obj + (".chunk" if chat else ""), choices=[choice])
        await resp.write(b"data: " + json.dumps(out).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def telemetry(request: web.Request) -> web.Response:
        return web.json_response(rank.telemetry())

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=rank.metrics(), headers={"X-LBD-Telemetry": "/telemetry"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    app = web.Application(client_max_size=8 << 20)
    app.router.add_get("/health", lambda r: web.Response())
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/telemetry", telemetry)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    return app


def control_app(fleet: Fleet) -> web.Application:
    async def act(request: web.Request) -> web.Response:
        rank = fleet.ranks[int(request.match_info["rank"])]
        action = request.match_info["action"]
        if action == "set":
            rank.override = {k: float(v) for k, v in (await request.json()).items()}
            rank.changed()
        elif action in ("pause", "resume"):
            rank.paused = action == "pause"
        elif action == "skip":
            rank.skip += 1
        elif action == "restart":
            rank.reset()
            rank.send()
        elif action == "forge":  # on this rank's socket, a message that claims another rank's identity
            body = await request.json()
            other = fleet.ranks[int(body["as"])]
            claim = other.state()
            claim.instance = str(body.get("instance", claim.instance))
            claim.seq, claim.rank = other.seq + 1000, int(body.get("rank", claim.rank))
            claim.running = int(body.get("running", 999))
            assert rank.pub is not None
            rank.pub.send_multipart((TOPIC, encode_state(claim)))
        else:
            raise web.HTTPNotFound()
        return web.json_response(rank.telemetry())

    async def stats(request: web.Request) -> web.Response:
        keys = ("prefix_queries", "prefix_hits", "prompt_tokens", "generation_tokens")
        return web.json_response({k: sum(getattr(r, k) for r in fleet.ranks) for k in keys})

    app = web.Application()
    app.router.add_post("/standin/{rank}/{action}", act)
    app.router.add_get("/standin/stats", stats)
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="fleet_standin.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--base-port", type=int, required=True)
    p.add_argument("--control-port", type=int, required=True)
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--no-push", action="store_true", help="publish nothing: routers scrape every rank")
    p.add_argument("--curve", action="store_true",
                   help="secure the streams with CURVE keys derived from $LBD_CLUSTER_TOKEN")
    p.add_argument("--sim-profile", default="h100-llama3-8b")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--default-max-tokens", type=int, default=16,
                   help="the tokens of an answer to a request without max_tokens")
    ns = p.parse_args(argv)
    if ns.ranks < 1 or ns.heartbeat_s <= 0:
        p.error("--ranks must be >= 1 and --heartbeat-s > 0")

    async def run() -> None:
        fleet = Fleet(ns)
        await fleet.start()
        print(f"fleet stand-in: {ns.ranks} ranks on ports {ns.base_port}..{ns.base_port + ns.ranks - 1}",
              flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
