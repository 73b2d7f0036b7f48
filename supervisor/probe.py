"""HTTP probes of a rank: its `/health`, and its in-flight request count for draining."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
import orjson

# Probe failure reasons (also the `reason` label of lbd_supervisor_probe_failures_total).
TIMEOUT, CONNECTION, CORE_DEAD, BAD_STATUS = "timeout", "connection", "status_503", "bad_status"
# Not a failure: a member of an MoE group answering 503 with this header is alive and waiting for its group
# to form (the header's value: forming | reforming).
GROUP_WAIT = "group_wait"
GROUP_STATE_HEADER = "X-lbd-dp-state"


@dataclass(slots=True)
class ProbeResult:
    ok: bool
    latency_s: float
    status: int | None = None
    reason: str | None = None  # one of the reasons above when not ok
    detail: str | None = None  # human-readable, shown in /status


class Prober:
    """One client session for every probe; a fresh connection per probe so a restarted rank is seen as new."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(force_close=True, limit=0)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout)
        return self._session

    async def health(self, base_url: str) -> ProbeResult:
        start = time.perf_counter()
        try:
            async with self._client().get(base_url + "/health") as resp:
                body = await resp.read()
                status = resp.status
                group_state = resp.headers.get(GROUP_STATE_HEADER)
        except TimeoutError:
            return ProbeResult(False, time.perf_counter() - start, None, TIMEOUT,
                               f"no answer within {self.timeout.total:g} s")
        except aiohttp.ClientError as e:
            return ProbeResult(False, time.perf_counter() - start, None, CONNECTION, _short(e))
        latency = time.perf_counter() - start
        if status == 200:
            return ProbeResult(True, latency, status)
        if status == 503 and group_state:
            return ProbeResult(False, latency, status, GROUP_WAIT, _group_wait_detail(group_state, body))
        reason = CORE_DEAD if status == 503 else BAD_STATUS
        return ProbeResult(False, latency, status, reason, f"/health answered {status}")

    async def in_flight(self, base_url: str) -> int | None:
        """Requests the rank is still working on: `/load`, else running + waiting from `/metrics`."""
        try:
            async with self._client().get(base_url + "/load") as resp:
                if resp.status == 200:
                    return int(orjson.loads(await resp.read())["server_load"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError, orjson.JSONDecodeError):
            pass
        try:
            async with self._client().get(base_url + "/metrics") as resp:
                if resp.status == 200:
                    text = await resp.text()
                    return int(_metric_sum(text, "vllm:num_requests_running")
                               + _metric_sum(text, "vllm:num_requests_waiting"))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        return None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            await asyncio.sleep(0)


def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _group_wait_detail(state: str, body: bytes) -> str:
    try:
        message = str(orjson.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError, orjson.JSONDecodeError):
        message = ""
    return f"waiting for its DP group ({state})" + (f": {message}" if message else "")


def _short(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."
