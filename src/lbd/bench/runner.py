"""Drive one target with a seeded workload: open loop (arrivals from a gamma process) or closed loop.

Open loop: sessions start at gamma-distributed gaps (shape ``burstiness``; 1 = Poisson) whose mean makes the
offered *request* rate ``request_rate`` (a multi-turn session of k turns counts k); ``max_concurrency`` then
caps requests in flight. Closed loop (no rate, ``max_concurrency`` = C): C sessions run back to back.
Each session's turns run in order and the next turn's history holds the previous answer. The requests issued
are reserved up front per session, so the same seed sends the same requests to every target.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from lbd.bench.client import RequestRecord, Target, send
from lbd.bench.stats import Summary, summarize, timeline
from lbd.bench.workloads import Session, TextSource, WorkloadSpec, chat_messages, completion_prompt, sessions

WARMUP_SEED_OFFSET = 7919  # warm-up draws from its own stream, so the measured workload does not change


class TargetError(RuntimeError):
    pass


@dataclass(slots=True)
class BenchConfig:
    endpoint: str = "completions"  # or "chat"
    num_prompts: int | None = 100
    duration: float | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    warmup: int = 0
    seed: int = 0
    stream: bool = True
    ignore_eos: bool = True
    temperature: float = 0.0
    session_header: bool = False
    think_time: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    timeout: float = 600.0
    slo: dict[str, float] = field(default_factory=dict)
    progress: bool = True


@dataclass(slots=True)
class RunResult:
    target: Target
    records: list[RequestRecord]
    duration_s: float
    summary: Summary
    started_at: float  # time.time() at the start of the measured run

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.target.name,
            "base_url": self.target.base_url,
            "model": self.target.model,
            "started_at": self.started_at,
            "summary": self.summary.as_dict(),
            "timeline": timeline(self.records),
            "requests": [r.summary_dict() for r in self.records],
        }


class _Progress:
    """One status line on stderr: redrawn in place on a terminal, a line per 10% otherwise."""

    def __init__(self, name: str, total: int | None, duration: float | None, enabled: bool) -> None:
        self.name, self.total, self.duration, self.enabled = name, total, duration, enabled
        self.done = self.failed = 0
        self.t0 = time.perf_counter()
        self._tty = sys.stderr.isatty()
        self._last_decile = -1

    def update(self, rec: RequestRecord) -> None:
        self.done += 1
        self.failed += not rec.ok
        if self.enabled and not self._tty:
            decile = int(10 * self._fraction())
            if decile > self._last_decile:
                self._last_decile = decile
                self._emit("\n")

    def _fraction(self) -> float:
        if self.total:
            return min(self.done / self.total, 1.0)
        if self.duration:
            return min((time.perf_counter() - self.t0) / self.duration, 1.0)
        return 0.0

    def _emit(self, end: str) -> None:
        frac = self._fraction()
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        elapsed = time.perf_counter() - self.t0
        of = f"/{self.total}" if self.total else ""
        lead = "\r" if self._tty else ""
        sys.stderr.write(
            f"{lead}[{self.name}] [{bar}] {self.done}{of} requests, {self.failed} failed, "
            f"{self.done / max(elapsed, 1e-9):.1f} req/s, {elapsed:.0f}s{end}"
        )
        sys.stderr.flush()

    async def ticker(self) -> None:
        if not (self.enabled and self._tty):
            return
        while True:
            self._emit("")
            await asyncio.sleep(0.5)

    def close(self) -> None:
        if self.enabled and self._tty:
            self._emit("\n")


class _Driver:
    def __init__(
        self,
        http: aiohttp.ClientSession,
        cfg: BenchConfig,
        spec: WorkloadSpec,
        target: Target,
        src: TextSource,
        budget: int | None,
        duration: float | None,
        progress: _Progress | None,
    ) -> None:
        self.http, self.cfg, self.spec, self.target, self.src = http, cfg, spec, target, src
        self.remaining = budget
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + duration if duration else math.inf
        self.records: list[RequestRecord] = []
        self.progress = progress
        self.chat = cfg.endpoint == "chat"
        self.url = target.base_url.rstrip("/") + ("/v1/chat/completions" if self.chat else "/v1/completions")
        self.sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

    # ---- budget ---------------------------------------------------------------------------------------
    def exhausted(self) -> bool:
        return (self.remaining is not None and self.remaining <= 0) or time.perf_counter() >= self.deadline

    def reserve(self, session: Session) -> int:
        """Turns this session may send (all of them, or what is left of the request budget)."""
        if self.exhausted():
            return 0
        if self.remaining is None:
            return len(session.turns)
        n = min(len(session.turns), self.remaining)
        self.remaining -= n
        return n

    # ---- requests -------------------------------------------------------------------------------------
    def _body(
        self, session: Session, done: list[tuple[str, str]], user: str, max_tokens: int
    ) -> dict[str, Any]:
        cfg = self.cfg
        body: dict[str, Any] = {
            "model": self.target.model,
            "max_tokens": max_tokens,
            "stream": cfg.stream,
            "temperature": cfg.temperature,
        }
        if self.chat:
            body["messages"] = chat_messages(session, done, user)
        else:
            body["prompt"] = completion_prompt(session, done, user)
        if cfg.stream:
            body["stream_options"] = {"include_usage": True}
        if cfg.ignore_eos:
            body["ignore_eos"] = True
        return body

    def _headers(self, session: Session) -> dict[str, str]:
        headers = {"Content-Type": "application/json", **self.cfg.headers}
        if self.cfg.session_header:
            headers["X-Session-ID"] = session.session_id
        return headers

    def _local_prompt_tokens(self, prompt: Any) -> int:
        if isinstance(prompt, str):
            return self.src.count(prompt)
        return sum(self.src.count(m["content"]) for m in prompt)

    async def _one(self, session: Session, turn: int, done: list[tuple[str, str]]) -> RequestRecord:
        t = session.turns[turn]
        body = self._body(session, done, t.user, t.max_tokens)
        rec = RequestRecord(
            session.session_id, turn, time.perf_counter() - self.t0, group=session.group, kind=session.kind
        )
        rec.prompt = body.get("messages", body.get("prompt"))
        ctx = self.sem if self.sem is not None else contextlib.nullcontext()
        async with ctx:
            rec.start = time.perf_counter() - self.t0
            await send(self.http, self.url, body, self._headers(session), rec, self.chat, self.cfg.timeout)
        if rec.ok and rec.prompt_tokens == 0:
            rec.prompt_tokens = self._local_prompt_tokens(rec.prompt)
        self.records.append(rec)
        if self.progress is not None:
            self.progress.update(rec)
        return rec

    async def session(self, session: Session, turns: int) -> None:
        done: list[tuple[str, str]] = []
        for i in range(turns):
            if i and self.cfg.think_time:
                await asyncio.sleep(self.cfg.think_time)
            if i and time.perf_counter() >= self.deadline:
                return
            rec = await self._one(session, i, done)
            if not rec.ok:
                return  # the conversation cannot go on without the answer
            done.append((session.turns[i].user, rec.text))

    # ---- arrival processes ----------------------------------------------------------------------------
    async def closed_loop(self, stream: Iterator[Session], concurrency: int) -> None:
        async def worker() -> None:
            while not self.exhausted():
                session = next(stream)
                await self.session(session, self.reserve(session))

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def open_loop(self, stream: Iterator[Session], rate: float, burstiness: float, seed: int) -> None:
        rng = random.Random(seed)
        session_rate = rate / self.spec.mean_turns
        tasks: set[asyncio.Task[None]] = set()
        next_at = time.perf_counter()
        try:
            while not self.exhausted():
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                    if self.exhausted():
                        break
                session = next(stream)  # reserved now: a task that has not run yet holds its turns
                tasks.add(asyncio.ensure_future(self.session(session, self.reserve(session))))
                if math.isfinite(session_rate):
                    next_at += rng.gammavariate(burstiness, 1.0 / (session_rate * burstiness))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()


async def discover_model(http: aiohttp.ClientSession, base_url: str) -> str:
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status != 200:
                raise TargetError(f"{url} answered {resp.status}: pass --model")
            data = orjson.loads(await resp.read()).get("data") or []
    except (aiohttp.ClientError, TimeoutError) as e:
        raise TargetError(f"cannot reach {url}: {e}") from e
    if not data:
        raise TargetError(f"{url} lists no model: pass --model")
    return str(data[0]["id"])


async def _drive(
    http: aiohttp.ClientSession,
    cfg: BenchConfig,
    spec: WorkloadSpec,
    target: Target,
    src: TextSource,
    seed: int,
    budget: int | None,
    duration: float | None,
    progress: _Progress | None,
) -> _Driver:
    driver = _Driver(http, cfg, spec, target, src, budget, duration, progress)
    stream = sessions(spec, src, seed)
    if math.isinf(cfg.request_rate) and cfg.max_concurrency:
        await driver.closed_loop(stream, cfg.max_concurrency)
    else:
        await driver.open_loop(stream, cfg.request_rate, cfg.burstiness, seed + 1)
    return driver


async def run_target(cfg: BenchConfig, spec: WorkloadSpec, target: Target, src: TextSource) -> RunResult:
    """Warm up (not measured), then run the seeded workload against ``target`` and summarize it."""
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        if not target.model:
            target.model = await discover_model(http, target.base_url)
        if cfg.warmup:
            await _drive(http, cfg, spec, target, src, cfg.seed + WARMUP_SEED_OFFSET, cfg.warmup, None, None)
        progress = _Progress(target.name, cfg.num_prompts, cfg.duration, cfg.progress)
        ticker = asyncio.ensure_future(progress.ticker())
        started_at = time.time()
        try:
            driver = await _drive(
                http, cfg, spec, target, src, cfg.seed, cfg.num_prompts, cfg.duration, progress
            )
        finally:
            ticker.cancel()
            progress.close()
    records = sorted(driver.records, key=lambda r: r.start)
    duration = max((r.end for r in records), default=0.0)
    return RunResult(target, records, duration, summarize(records, duration, cfg.slo), started_at)
