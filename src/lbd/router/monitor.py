"""Background loops: scrape each endpoint's /metrics, probe /health (eject, half-open re-admit), learn each
endpoint's models, and follow supervisors' /status and the upstreams file. What they learn goes to the
endpoints' owner (``lbd.router.endpoints.Fleet``, which ``RouterState`` is) through its named methods.

The GETs go through ``lbd.router.upstream`` pools of their own (one per base URL, apart from the proxied
requests' pools): with N workers scraping every endpoint every 100 ms, aiohttp's client costs an idle
router noticeable CPU, most of it per-request client overhead (benchmarks/RESULTS.md, "Scrape client").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import orjson

from lbd.common.limits import peer_read_cap, read_upstream
from lbd.router.config import Upstream, read_upstreams_file
from lbd.router.discovery import follow_dns
from lbd.router.endpoints import Endpoint
from lbd.router.outlier import CHECK_INTERVAL_S
from lbd.router.state import RouterState
from lbd.router.telemetry import TELEMETRY_HEADER, parse_metrics, parse_telemetry
from lbd.router.upstream import UpstreamError, UpstreamPool
from lbd.wire.states import RankState

if TYPE_CHECKING:
    from lbd.router.load_feed import LoadFeed
    from lbd.wire.status import SupervisorStatus

log = logging.getLogger("lbd.router")
_GET_ERRORS = (UpstreamError, TimeoutError, OSError)  # OSError: refused, reset, TLS, DNS


class Monitor:
    def __init__(self, state: RouterState) -> None:
        self.state = state
        self.cfg = state.cfg
        self.pools: dict[str, UpstreamPool] = {}  # base URL -> keep-alive connections for these GETs
        self.tasks: dict[str, list[asyncio.Task[None]]] = {}
        self.source_tasks: list[asyncio.Task[None]] = []
        self.file_urls: set[str] = set()
        key = self.cfg.upstream_api_key
        self._auth = b"Authorization: Bearer %s\r\n" % key.encode() if key else b""
        # pushed telemetry (lbd.router.load_feed): ranks that publish their load are not scraped while fresh;
        # started with the first rank that advertises a stream (a router over peers that publish none never
        # loads it)
        self.push: LoadFeed | None = None
        state.on_added.append(self._start_endpoint)
        state.on_removed.append(self._stop_endpoint)

    # ---- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        for up in self.cfg.upstreams:
            self._start_source(up, "static")
        if self.cfg.upstreams_file is not None:
            self.reload_file()
        self.source_tasks.append(asyncio.ensure_future(self._outlier_loop()))

    def _start_source(self, up: Upstream, source: str) -> None:
        if up.kind == "supervisor":
            self.source_tasks.append(asyncio.ensure_future(self._follow_supervisor(up)))
        elif up.kind == "supervisor-dns":
            task = asyncio.ensure_future(follow_dns(up, self.cfg.dns_refresh_interval_s,
                                                    self._follow_found, self.forget_source))
            task.lbd_url = up.url  # type: ignore[attr-defined]
            self.source_tasks.append(task)
        else:
            self.state.add(up.url, source)

    def _follow_found(self, up: Upstream) -> asyncio.Task[None]:
        """A supervisor found by DNS: followed until its address leaves the name (then cancelled)."""
        return asyncio.ensure_future(self._follow_supervisor(up))

    def forget_source(self, source: str) -> None:
        """Drop every endpoint a supervisor listed (it is no longer followed)."""
        for url in [u for u, e in self.state.endpoints.items() if e.source == source]:
            self.state.remove(url)

    def reload_file(self) -> None:
        """(Re)read --upstreams-file: add what is new, drop file endpoints that are gone (SIGHUP)."""
        assert self.cfg.upstreams_file is not None
        try:
            ups = read_upstreams_file(self.cfg.upstreams_file)
        except (OSError, ValueError) as e:
            log.error("cannot reload %s: %s (keeping the previous list)", self.cfg.upstreams_file, e)
            return
        urls = {u.url for u in ups if u.kind == "engine"}
        for url in self.file_urls - urls:
            self.state.remove(url)
        for up in ups:
            if up.kind == "engine" and up.url not in self.file_urls:
                self.state.add(up.url, "file")
            elif up.kind in ("supervisor", "supervisor-dns") and up.url not in self._followed():
                self._start_source(up, "file")
        self.file_urls = urls
        log.info(
            "upstreams file read: %d engines, %d supervisors",
            len(urls),
            sum(u.kind != "engine" for u in ups),
        )

    def _followed(self) -> set[str]:
        return {getattr(t, "lbd_url", "") for t in self.source_tasks}

    async def close(self) -> None:
        tasks = [t for ts in self.tasks.values() for t in ts] + self.source_tasks
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.push is not None:
            await self.push.close()
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()

    def _start_endpoint(self, ep: Endpoint) -> None:
        self.tasks[ep.url] = [
            asyncio.ensure_future(self._scrape_loop(ep)),
            asyncio.ensure_future(self._health_loop(ep)),
        ]
        self._refetch_models(ep)
        if self.state.exact is not None:
            block_size = lambda: (ep.sample.block_size if ep.sample is not None else 0) or 16  # noqa: E731
            capacity = lambda: ep.sample.num_blocks if ep.sample is not None else 0  # noqa: E731
            self.state.exact.add(ep.url, lambda: ep.models, block_size, ep.slot, capacity)

    def _refetch_models(self, ep: Endpoint) -> None:
        """A (re)started process may serve other models: ask again (tracked, so removal cancels it)."""
        tasks = self.tasks.setdefault(ep.url, [])
        tasks[:] = [t for t in tasks if not t.done()]
        tasks.append(asyncio.ensure_future(self._fetch_models(ep)))

    def _stop_endpoint(self, ep: Endpoint) -> None:
        for t in self.tasks.pop(ep.url, []):
            t.cancel()
        if self.state.exact is not None:
            self.state.exact.remove(ep.url)
        if self.push is not None:
            self.push.remove(ep.url)
        pool = self.pools.pop(ep.url, None)
        if pool is not None:
            pool.close()

    # ---- telemetry ------------------------------------------------------------------------------------
    async def _get(self, url: str, timeout: float, engine: bool = True) -> tuple[int, bytes]:
        """GET ``url`` (``scheme://host:port/path``) within ``timeout`` s: (status, body). Engines get the
        --upstream-api-key (their /v1/models needs it)."""
        status, _, body = await self._get_with_headers(url, timeout, engine)
        return status, body

    async def _get_with_headers(self, url: str, timeout: float,
                                engine: bool = True) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """``_get``, with the answer's raw headers: (status, headers, body)."""
        scheme, _, rest = url.partition("://")
        host, slash, path = rest.partition("/")
        base = f"{scheme}://{host}"
        pool = self.pools.get(base)
        if pool is None:
            pool = self.pools[base] = UpstreamPool(base, timeout, self.state.tls)
        headers = self._auth if engine else b""
        async with asyncio.timeout(timeout):
            resp = await pool.request("GET", slash + path, headers, b"", timeout)
            try:
                return resp.status, resp.raw_headers, await read_upstream(resp, peer_read_cap(path), what=url)
            finally:
                resp.close()

    async def _scrape_loop(self, ep: Endpoint) -> None:
        """Scrape ``ep`` now, then every ``workers`` intervals: the workers take turns, so a rank serves the
        configured scrape rate whatever the worker count (each worker's samples are older; the shared
        dispatch counters carry what happened since)."""
        loop = asyncio.get_running_loop()
        interval = self.cfg.scrape_interval_s * max(1, self.cfg.workers)
        while True:
            if self.push is not None and self.push.fresh(ep.url):
                await self.push.until_stale(ep.url)  # its pushed state is fresh: no scrape until it is not
            began = loop.time()
            if ep.healthy and ep.routable:
                await self.scrape(ep)
            await asyncio.sleep(max(0.0, interval - (loop.time() - began)))

    async def scrape(self, ep: Endpoint) -> None:
        """Read ``ep``'s load: /metrics, or the JSON path its /metrics advertised (X-LBD-Telemetry: lbd's
        engines), which costs the engine a small fraction of a Prometheus render (benchmarks/RESULTS.md,
        "JSON telemetry"). A JSON path that stops answering (the URL now serves another engine, e.g. vLLM)
        sends the endpoint back to /metrics."""
        loop = asyncio.get_running_loop()
        totals = self.state.shared.totals(ep.slot)
        began = loop.time()
        path = ep.telemetry_path
        try:
            status, headers, body = await self._get_with_headers(ep.url + path, self.cfg.scrape_timeout_s)
        except _GET_ERRORS as e:
            self.state.scrape_failed(ep, f"{path}: {type(e).__name__}: {e}".rstrip(": "))
            return
        if status >= 500:
            self.state.scrape_failed(ep, f"{path} answered {status}")
            return
        try:
            if status != 200:  # a 4xx is not a health signal (and the numbers are unknown)
                raise ValueError(f"{path} answered {status}")
            if path == "/metrics":
                sample = parse_metrics(body.decode("utf-8", "replace"))
                self.state.use_telemetry(ep, _advertised(headers))
            else:
                sample = parse_telemetry(body)
        except ValueError as e:
            if path != "/metrics":
                log.info("%s: %s; reading /metrics again", ep.url, e)
                self.state.refuse_telemetry(ep)
            return
        prev = ep.sample
        if prev is not None and not ep.new_process and sample.prefix_queries < prev.prefix_queries:
            self.state.restarted(ep, "its counters went back")
        self.state.observe(ep, sample, began, totals)
        self.state.succeeded(ep, "scrape")
        if sample.load_stream is not None and self.cfg.telemetry_push != "off":
            self._load_feed().adopt(ep, sample.load_stream)

    def _load_feed(self) -> LoadFeed:
        if self.push is None:
            from lbd.router.load_feed import LoadFeed  # lazily: on first use, for cold start

            self.push = self.state.push = LoadFeed(self.state)
            self.push.start()
        return self.push

    async def _health_loop(self, ep: Endpoint) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            if not ep.routable:
                continue
            ok, error = await self.probe(ep)
            if not ep.healthy:
                if ep.ejected_by == "outlier":
                    continue  # its front end answers probes: only its half-open trial request re-admits it
                # half-open: one good probe, at least an interval after the ejection, re-admits
                if ok and loop.time() - ep.ejected_at >= self.cfg.health_interval_s * 0.5:
                    self.state.readmit(ep, "health probe answered 200")
                    self._refetch_models(ep)
                continue
            if ok:
                self.state.succeeded(ep, "probe")
            else:
                self.state.fail(ep, "probe", error)

    async def probe(self, ep: Endpoint) -> tuple[bool, str]:
        try:
            status, _ = await self._get(ep.url + "/health", self.cfg.health_timeout_s)
        except _GET_ERRORS as e:
            return False, f"/health: {type(e).__name__}: {e}".rstrip(": ")
        if status >= 500:
            return False, f"/health answered {status}"
        return True, ""

    async def _fetch_models(self, ep: Endpoint) -> None:
        """Learn the served models from /v1/models (retried until it answers)."""
        delay = 0.2
        while True:
            with contextlib.suppress(*_GET_ERRORS, orjson.JSONDecodeError):
                status, body = await self._get(ep.url + "/v1/models", self.cfg.health_timeout_s)
                if status == 200:
                    cards = [
                        c for c in orjson.loads(body).get("data", []) if isinstance(c, dict) and "id" in c
                    ]
                    self.state.set_models(ep, cards)
                    return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _outlier_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            self.state.outliers.check(loop.time())

    # ---- supervisors --------------------------------------------------------------------------------
    async def _follow_supervisor(self, up: Upstream) -> None:
        # the typed /status only where a supervisor:// upstream is followed (its structs cost ms at start)
        from lbd.wire.status import decode_supervisor_status

        task = asyncio.current_task()
        if task is not None:
            task.lbd_url = up.url  # type: ignore[attr-defined]
        warned = False
        while True:
            try:
                status, body = await self._get(
                    up.status_url, max(1.0, self.cfg.health_timeout_s), engine=False
                )
                if status != 200:
                    raise ValueError(f"/status answered {status}")
                self.apply_status(up.url, decode_supervisor_status(body))
                warned = False
            except (*_GET_ERRORS, ValueError) as e:
                if not warned:
                    log.warning("supervisor %s unreachable (%s); keeping its last known ranks", up.url, e)
                    warned = True
            await asyncio.sleep(self.cfg.supervisor_poll_interval_s)

    def apply_status(self, source: str, status: SupervisorStatus) -> None:
        """Mirror a supervisor's /status: ranks appear, leave, drain, restart (new pid)."""
        seen: set[str] = set()
        for r in status.ranks:
            url = r.url.rstrip("/")
            if not url:
                continue
            seen.add(url)
            ep = self.state.add(url, source, r.rank)
            if self.state.supervise(ep, bool(r.routable), r.state is RankState.DRAINING, r.role.value, r.pid,
                                    r.state.value):
                self._refetch_models(ep)  # a (re)started process the supervisor found ready
        for url in [u for u, e in self.state.endpoints.items() if e.source == source and u not in seen]:
            self.state.remove(url)


def _advertised(headers: list[tuple[bytes, bytes]]) -> str:
    """The JSON telemetry path a /metrics answer advertises (an absolute path), else /metrics."""
    for name, value in headers:
        if name.lower() == TELEMETRY_HEADER:
            path = value.decode("latin-1").strip()
            if path.startswith("/") and not path.startswith("//") and path.isprintable() and " " not in path:
                return path
    return "/metrics"
