"""benchmarks/elastic.py's load and its records: an open-loop load that steps between levels, each streamed
answer timed (TTFT) and checked whole, and a poller that records the fleet's size over time.

Every request is a streamed greedy completion with ``ignore_eos`` on ``--device sim`` ranks, of one of two
kinds: ``short`` (a ~160-token prompt, 32 tokens out) and ``long`` (the same prompt size, 500 tokens out).
Shorts arrive as a Poisson process at ``short_rate x level``; longs every ``long_every_s / level`` seconds,
evenly, so 500-token streams are always running. The stream is read as bytes; TTFT is the time to the first
chunk that carries text. The body is then parsed by the chaos soak's reader (``soak_mix.read_stream``) and
held to what an unbroken sim answer is (``sim_judge``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import threading
import time
from dataclasses import dataclass, field

import aiohttp
import httpx

from soak_mix import COMPLETIONS, Kind, read_stream

FIRST_TEXT = re.compile(rb'"text":\s*"[^"]')
WORDS = ("harbour lantern meadow copper violin orchard thunder pebble saddle glacier ember willow canyon "
         "falcon marble velvet cobalt ivory prairie quartz").split()


@dataclass(frozen=True)
class Phase:
    level: float  # the load's multiple of the base rates
    seconds: float


@dataclass
class Record:
    """One request: when it started (s since the run's t0), its kind, phase, TTFT and how it ended."""

    i: int
    kind: str
    phase: int
    start: float
    max_tokens: int
    ttft: float | None = None
    end: float | None = None
    outcome: str = "ok"  # ok | error (no stream: status, connection) | cut (a stream that is not whole)
    reason: str = ""


def prompt(i: int, words: int) -> str:
    """A prompt of its own (no prefix-cache hits between requests) of ``words`` words."""
    rng = random.Random(i)
    return f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def sim_judge(sse: str, max_tokens: int, words_are_tokens: bool = True) -> tuple[str, str]:
    """("ok" | "cut", why) for a 200 stream's body. Whole: no error event, one [DONE] and nothing after it,
    one finish reason ("length": ignore_eos), usage's completion_tokens = max_tokens, and (sim ranks,
    ``words_are_tokens``) as many words as tokens (a sim token is one word with its space, so a gap or a
    repeat changes the count). The sim's words are a hash of the prompt and the position, so a stream
    resumed elsewhere (a new token prompt) goes on with other words: the text is checked for count, not
    against an unbroken copy (the chaos part is). A real model's tokens are not words: count only."""
    a = read_stream(Kind("sim", COMPLETIONS, {}), sse)
    if a.errors:
        return "cut", "error event: " + a.errors[0][:120]
    if a.dones != 1 or a.trailing:
        return "cut", f"{a.dones} [DONE]" + (", data after it" if a.trailing else "")
    if a.finishes != ["length"]:
        return "cut", f"finish reasons {a.finishes}"
    if a.tokens != max_tokens:
        return "cut", f"usage says {a.tokens} tokens of {max_tokens}"
    words = len(a.text.split())
    if words_are_tokens and words != max_tokens:
        return "cut", f"{words} words for {max_tokens} tokens (a gap or a repeat)"
    return "ok", ""


@dataclass
class StepLoad:
    url: str
    model: str
    phases: list[Phase]
    short_rate: float  # shorts per second at level 1
    long_every_s: float  # a long stream this often at level 1
    prompt_words: int = 44  # ~260 tokens of the tiny tokenizer
    short_tokens: int = 32
    long_tokens: int = 500
    seed: int = 0
    words_are_tokens: bool = True  # sim ranks (sim_judge)
    records: list[Record] = field(default_factory=list)

    def arrivals(self) -> list[tuple[float, str, int]]:
        """(start s, kind, phase) of every request, sorted: the same for every run with the same seed."""
        rng = random.Random(self.seed)
        out: list[tuple[float, str, int]] = []
        begin = 0.0
        for n, ph in enumerate(self.phases):
            t = begin
            while (t := t + rng.expovariate(self.short_rate * ph.level)) < begin + ph.seconds:
                out.append((t, "short", n))
            t = begin + 0.5
            while t < begin + ph.seconds:
                out.append((t, "long", n))
                t += self.long_every_s / ph.level
            begin += ph.seconds
        return sorted(out)

    async def run(self, t0: float) -> None:
        """Sends every arrival at its time after ``t0`` (time.monotonic()), whatever the answers."""
        conn = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=900, sock_read=300)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
            tasks = []
            for i, (at, kind, phase) in enumerate(self.arrivals()):
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                tokens = self.long_tokens if kind == "long" else self.short_tokens
                rec = Record(i, kind, phase, time.monotonic() - t0, tokens)
                self.records.append(rec)
                tasks.append(asyncio.create_task(self.one(http, rec, t0)))
            await asyncio.gather(*tasks)

    async def one(self, http: aiohttp.ClientSession, rec: Record, t0: float) -> None:
        body = {"model": self.model, "prompt": prompt(rec.i, self.prompt_words), "max_tokens": rec.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        began = time.monotonic()
        raw = bytearray()
        try:
            async with http.post(self.url + COMPLETIONS, json=body) as resp:
                if resp.status != 200:
                    rec.outcome, rec.reason = "error", f"status {resp.status}: {(await resp.read())[:120]!r}"
                else:
                    async for chunk in resp.content.iter_any():
                        raw += chunk
                        if rec.ttft is None and FIRST_TEXT.search(raw):
                            rec.ttft = time.monotonic() - began
                    rec.outcome, rec.reason = sim_judge(raw.decode("utf-8", "replace"), rec.max_tokens,
                                                            self.words_are_tokens)
        except (aiohttp.ClientError, TimeoutError) as e:
            rec.outcome = "cut" if raw else "error"
            rec.reason = f"{type(e).__name__}: {e}"[:160]
        rec.end = time.monotonic() - t0


class Poller(threading.Thread):
    """Every ``every_s``: the node's size (its health port's /status) and what its router routes to, with the
    router's autoscale recommendation; every resize record (/status's ``scaling``) by its start."""

    def __init__(self, health_url: str, router_url: str, t0: float, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.health_url, self.router_url, self.t0, self.every_s = health_url, router_url, t0, every_s
        self.rows: list[dict] = []
        self.resizes: dict[float, dict] = {}  # started_at (unix) -> the last record seen
        self.stop = threading.Event()
        self.offset = time.time() - time.monotonic()  # unix = monotonic + offset

    def run(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            while not self.stop.is_set():
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    self.sample(client)
                self.stop.wait(self.every_s)

    def sample(self, client: httpx.Client) -> None:
        node = client.get(self.health_url + "/status").json()
        router = client.get(self.router_url + "/router/status").json()
        states = [e["state"] for e in router["endpoints"]]
        scaling = node.get("scaling")
        if scaling and scaling.get("started_at"):
            self.resizes[scaling["started_at"]] = scaling
        auto = router.get("autoscale") or {}
        signals = auto.get("signals") or {}
        self.rows.append({"t": round(time.monotonic() - self.t0, 2), "ranks": len(node["ranks"]),
                          "size": node["data_parallel_size_local"], "ready": node["ready_ranks"],
                          "routed": states.count("ready"), "draining": states.count("draining"),
                          "recommended": auto.get("recommended_ranks"),
                          "saturation": signals.get("saturation"), "backlog": signals.get("token_backlog"),
                          "served": signals.get("served_tokens_per_s"),
                          "offered": signals.get("offered_tokens_per_s"), "load1": os.getloadavg()[0]})

    def rel(self, unix: float | None) -> float | None:
        """A unix time as seconds since t0."""
        return None if unix is None else round(unix - self.offset - self.t0, 2)
