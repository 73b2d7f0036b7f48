"""HTTP probes of a rank: its `/health`, a 1-token generation, and its in-flight request count for draining.

Ranks that serve TLS are probed over https and their certificates verified (``--ssl-ca-certs``, else the
system's trust store)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from dataclasses import dataclass
from typing import NamedTuple

import aiohttp
import orjson

from lbd.common.limits import PeerReadTooLarge, read_aiohttp

# (running, waiting) gauges of the engines a rank may run: vLLM's names (lbd's too), SGLang's
_IN_FLIGHT = (("vllm:num_requests_running", "vllm:num_requests_waiting"),
              ("sglang:num_running_reqs", "sglang:num_queue_reqs"))
_KV_USAGE = ("vllm:kv_cache_usage_perc", "sglang:token_usage")  # the same engines' KV-cache use (0..1)
# their cumulative prompt and generated token counters (a rank's throughput: lbd.common.throughput)
_TOKENS = (("vllm:prompt_tokens_total", "vllm:generation_tokens_total"),
           ("sglang:prompt_tokens_total", "sglang:generation_tokens_total"))
# Probe failure reasons (also the `reason` label of lbd_supervisor_probe_failures_total).
TIMEOUT, CONNECTION, CORE_DEAD, BAD_STATUS = "timeout", "connection", "status_503", "bad_status"
# Not a failure: a member of an MoE group answering 503 with this header is alive and waiting for its group
# to form (the header's value: forming | reforming).
GROUP_WAIT = "group_wait"
GROUP_STATE_HEADER = "X-lbd-dp-state"
GENERATE_TIMEOUT, GENERATE_FAILED = "generate_timeout", "generate_failed"


@dataclass(slots=True)
class ProbeResult:
    ok: bool
    latency_s: float
    status: int | None = None
    reason: str | None = None  # one of the reasons above when not ok
    detail: str | None = None  # human-readable, shown in /status


class Prober:
    """One client session for every probe; a fresh connection per probe so a restarted rank is seen as new."""

    def __init__(self, timeout_s: float, ssl_context: ssl.SSLContext | None = None) -> None:
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._ssl = ssl_context
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(force_close=True, limit=0, ssl=self._ssl or True)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout)
        return self._session

    async def _call(self, method: str, url: str, timeout_reason: str, timeout_what: str,
                    **kw: object) -> tuple[int, bytes, float, str | None] | ProbeResult:
        """(status, body, latency, the X-lbd-dp-state header), or the failed ProbeResult of a timeout or a
        connection error."""
        start = time.perf_counter()
        try:
            async with self._client().request(method, url, **kw) as resp:
                body = await read_aiohttp(resp)
                return resp.status, body, time.perf_counter() - start, resp.headers.get(GROUP_STATE_HEADER)
        except TimeoutError:
            return ProbeResult(False, time.perf_counter() - start, None, timeout_reason,
                               f"{timeout_what} within {self.timeout.total:g} s")
        except (aiohttp.ClientError, PeerReadTooLarge) as e:
            return ProbeResult(False, time.perf_counter() - start, None, CONNECTION, _short(e))

    async def health(self, base_url: str) -> ProbeResult:
        got = await self._call("GET", base_url + "/health", TIMEOUT, "no answer")
        if isinstance(got, ProbeResult):
            return got
        status, body, latency, group_state = got
        if status == 200:
            return ProbeResult(True, latency, status)
        if status == 503 and group_state:
            return ProbeResult(False, latency, status, GROUP_WAIT, _group_wait_detail(group_state, body))
        why = _error_message(body)
        return ProbeResult(False, latency, status, CORE_DEAD if status == 503 else BAD_STATUS,
                           f"/health answered {status}" + (f": {why}" if why else ""))

    async def generate(self, base_url: str, model: str, api_key: str | None) -> ProbeResult:
        """A 1-token completion: proves the core still steps, where /health can only show a stall once it
        has work. A 503 (admission control, draining) is an answer, so it passes; the /health probes catch a
        dead core."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        body = {"model": model, "prompt": "ping", "max_tokens": 1, "temperature": 0}
        got = await self._call("POST", base_url + "/v1/completions", GENERATE_TIMEOUT,
                               "1-token generation not done", json=body, headers=headers)
        if isinstance(got, ProbeResult):
            return got
        status, text, latency, _ = got
        if status in (200, 503):
            return ProbeResult(True, latency, status)
        return ProbeResult(False, latency, status, GENERATE_FAILED,
                           f"1-token generation answered {status}: {_error_message(text) or status}")

    async def kv_event_sources(self, base_url: str) -> dict | None:
        """The rank's ``/kv_event_sources`` (vLLM's: publisher config per DP rank); None if unanswered."""
        return await self._json(base_url + "/kv_event_sources")

    async def _json(self, url: str) -> dict | None:
        """A JSON object from ``url`` (capped like every peer read), or None when there is none."""
        try:
            async with self._client().get(url) as resp:
                if resp.status == 200:
                    body = orjson.loads(await read_aiohttp(resp))
                    return body if isinstance(body, dict) else None
        except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError):
            pass
        return None

    async def _metrics(self, base_url: str) -> str:
        """The rank's ``/metrics`` text ("" when unanswered)."""
        try:
            async with self._client().get(base_url + "/metrics") as resp:
                if resp.status == 200:
                    return (await read_aiohttp(resp)).decode("utf-8", "replace")
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            pass
        return ""

    async def in_flight(self, base_url: str) -> int | None:
        """Requests the rank is still working on: `/load`, else running + waiting from `/metrics` (vLLM's or
        SGLang's names)."""
        body = await self._json(base_url + "/load") or {}
        with contextlib.suppress(KeyError, TypeError, ValueError):
            return int(body["server_load"])
        text = await self._metrics(base_url)
        for running, waiting in _IN_FLIGHT:
            if running in text:
                return int(_metric_sum(text, running) + _metric_sum(text, waiting))
        return None

    async def load(self, base_url: str) -> RankLoad | None:
        """The rank's load for the autoscaling signals: lbd's JSON `/telemetry` (vLLM's names without the
        prefix), else `/metrics` (vLLM's or SGLang's names); None when it tells neither."""
        data = await self._json(base_url + "/telemetry") or {}
        with contextlib.suppress(KeyError, TypeError, ValueError):
            waiting, kv = float(data["num_requests_waiting"]), float(data["kv_cache_usage_perc"])
            prompt, generated = data.get("prompt_tokens_total"), data.get("generation_tokens_total")
            known = all(isinstance(c, int | float) and not isinstance(c, bool) for c in (prompt, generated))
            return RankLoad(waiting, kv, float(prompt) + float(generated) if known else None)
        text = await self._metrics(base_url)
        for (_, waiting_name), kv_name, tokens in zip(_IN_FLIGHT, _KV_USAGE, _TOKENS, strict=True):
            if waiting_name in text:
                told = any(name in text for name in tokens)
                return RankLoad(_metric_sum(text, waiting_name), _metric_sum(text, kv_name),
                                sum(_metric_sum(text, name) for name in tokens) if told else None)
        return None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            await asyncio.sleep(0)


class RankLoad(NamedTuple):
    """What ``Prober.load`` read of a rank: its waiting requests, KV-cache use (0..1) and its prompt plus
    generated tokens so far (cumulative; None where the engine does not tell)."""

    waiting: float
    kv_usage: float
    tokens: float | None = None


def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _group_wait_detail(state: str, body: bytes) -> str:
    message = _error_message(body)
    return f"waiting for its DP group ({state})" + (f": {message}" if message else "")


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body, else the body's first line (shortened)."""
    try:
        return _short(str(orjson.loads(body)["error"]["message"]))
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return _short(body.decode("utf-8", "replace").strip().split("\n", 1)[0])


def _short(e: BaseException | str) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."
