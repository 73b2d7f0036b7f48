"""The router's endpoint table: add/remove endpoints, health transitions, snapshots for the policies.

An endpoint holds a shared-counter slot (lbd.router.shared) from ``add`` to ``remove``; removing it releases
the slot, so endpoints that come and go (pod IPs, Ray ports) never fill the table."""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Iterable
from typing import TYPE_CHECKING

from lbd.common.tls import client_context
from lbd.policies import EndpointSnapshot, Policy, RequestFacts, make_policy
from lbd.policies.sample import SAMPLE_ABOVE, SAMPLE_K, holder_keys, sample_indices
from lbd.router.config import RouterConfig
from lbd.router.endpoints import Endpoint
from lbd.router.kv.view import ExactView
from lbd.router.metrics import RouterMetrics
from lbd.router.outlier import Outliers, ejection_cap
from lbd.router.shared import SharedCounters
from lbd.router.upstream import UpstreamPool

if TYPE_CHECKING:
    from lbd.router.load_feed import LoadFeed

log = logging.getLogger("lbd.router")


class RouterState:
    def __init__(self, cfg: RouterConfig, shared: SharedCounters) -> None:
        self.cfg = cfg
        self.shared = shared
        # verifies https:// upstreams against --ssl-ca-certs (else the system's trust store)
        self.tls = client_context(cfg.ssl_ca_certs)
        self.loop = asyncio.get_running_loop()
        self.endpoints: dict[str, Endpoint] = {}
        self.pools: dict[str, UpstreamPool] = {}
        self.order: list[Endpoint] = []
        self.policy: Policy = make_policy(
            cfg.policy,
            stale_s=cfg.stale_after_s,
            seed=shared.worker,
            prefill_tokens_per_s=cfg.prefill_tokens_per_s,
            evict_weight=cfg.evict_weight,
        )
        self.exact: ExactView | None = None  # set by the app when --kv-events is not off
        self.push: LoadFeed | None = None  # set by the monitor unless --telemetry-push off
        self.metrics = RouterMetrics(self.live_rows, self.kv_rows, self.push_rows)
        self.outliers = Outliers(self, cfg.outlier_first_byte_timeout_s, cfg.outlier_ejection_s)
        self.on_added: list = []  # callbacks(endpoint) run when an endpoint appears (start its monitors)
        self.on_removed: list = []
        self._rng = random.Random(shared.worker)  # the decision's sample (snapshots_for)

    def add(self, url: str, source: str, rank: int | None = None) -> Endpoint:
        ep = self.endpoints.get(url)
        if ep is not None:
            if rank is not None and rank != ep.rank:
                ep.rank = rank
                self.reorder()
            return ep
        slot = self.shared.slot(url)
        if slot < 0:
            raise RuntimeError(f"shared counter table is full; cannot add {url}")
        ep = Endpoint(url=url, source=source, slot=slot, rank=rank, progress_at=self.loop.time())
        self.endpoints[url] = ep
        self.pools[url] = UpstreamPool(url, self.cfg.connect_timeout_s, self.tls)
        self.reorder()
        log.info("endpoint added: %s (rank %s, from %s)", url, rank, source)
        for cb in self.on_added:
            cb(ep)
        return ep

    def remove(self, url: str) -> None:
        ep = self.endpoints.pop(url, None)
        if ep is None:
            return
        self.reorder()
        self.policy.forget(url)
        self.outliers.forget(ep)
        pool = self.pools.pop(url, None)
        if pool is not None:
            pool.close()
        log.info("endpoint removed: %s (rank %s)", url, ep.rank)
        for cb in self.on_removed:
            cb(ep)
        self.shared.release(ep.slot)  # freed once no worker holds it and its requests have ended

    def reorder(self) -> None:
        self.order = sorted(
            self.endpoints.values(), key=lambda e: (e.rank if e.rank is not None else 1 << 30, e.url)
        )

    def snapshots(self, load: bool = True) -> list[EndpointSnapshot]:
        """Every endpoint as the policy sees it; without ``load`` the live numbers (in flight, delta, age) are
        left as they were (for a policy that reads none of them)."""
        if not load:
            return [ep.static_snapshot() for ep in self.order]
        now = self.loop.time()
        return [ep.snapshot(self.shared, now) for ep in self.order]

    def snapshots_for(self, facts: RequestFacts) -> list[EndpointSnapshot]:
        """The endpoints one decision looks at: every one up to ``SAMPLE_ABOVE``, else a random ``SAMPLE_K``
        and those holding the request's prefix (lbd.policies.sample). A pinned request sees every one."""
        order = self.order
        if len(order) <= SAMPLE_ABOVE or facts.pinned_rank is not None:
            return self.snapshots()
        now = self.loop.time()
        picked = {id(order[i]): order[i] for i in sample_indices(len(order), SAMPLE_K, self._rng)}
        for key in holder_keys(self.policy, facts, rng=self._rng):
            ep = self.endpoints.get(key)
            if ep is not None:
                picked[id(ep)] = ep
        return [ep.snapshot(self.shared, now) for ep in picked.values()]

    def fail(self, ep: Endpoint, source: str, error: str) -> None:
        """A connect error, timeout or 5xx from ``ep`` seen by ``source`` (probe, scrape or request). Failed
        requests count against --outlier-consecutive-5xx and may not eject more than
        --outlier-max-ejection-percent of the endpoints: one client's bad requests cannot empty the fleet."""
        passive = source == "request"
        threshold = self.cfg.outlier_consecutive_5xx if passive else self.cfg.health_failure_threshold
        allowed = not passive or self.may_eject(ep)
        if ep.record_failure(source, error, threshold, self.loop.time(), allowed):
            self.metrics.ejections.labels(ep.url).inc()
            log.warning(
                "endpoint ejected: %s (rank %s) after %d failures: %s", ep.url, ep.rank, ep.failures, error
            )

    def may_eject(self, ep: Endpoint) -> bool:
        """Whether a passive signal may eject ``ep`` now (--outlier-max-ejection-percent)."""
        ejected = sum(1 for e in self.endpoints.values() if not e.healthy and e is not ep)
        return ejected + 1 <= ejection_cap(len(self.endpoints), self.cfg.outlier_max_ejection_percent)

    def readmit(self, ep: Endpoint, why: str) -> None:
        if not ep.healthy:
            self.metrics.readmissions.labels(ep.url).inc()
            log.info("endpoint re-admitted: %s (rank %s): %s", ep.url, ep.rank, why)
            self.policy.forget(ep.url)  # it may be a new process: nothing it held is known to be cached
            ep.new_process = True
            ep.forgot_at = self.loop.time()
        self.outliers.forget(ep)
        ep.readmit()

    def restarted(self, ep: Endpoint, why: str) -> None:
        """The process behind ``ep`` is new: its prefix cache is cold."""
        log.info("endpoint %s (rank %s) restarted (%s): forgetting what it had cached", ep.url, ep.rank, why)
        ep.new_process = True
        ep.forgot_at = self.loop.time()
        ep.telemetry_refused = False  # a new process may serve the JSON telemetry its /metrics advertises
        self.policy.forget(ep.url)
        if self.exact is not None:
            self.exact.restarted(ep.url, why)

    def push_rows(self) -> Iterable[tuple[str, float, bool]]:
        return self.push.rows() if self.push is not None else ()

    def kv_rows(self) -> list[tuple[str, float, float, int]]:
        return self.exact.metric_rows() if self.exact is not None else []

    def ready_count(self) -> int:
        """Endpoints that take traffic and have answered us (a scrape or their model list)."""
        return sum(
            e.healthy and e.routable and not e.draining and (e.sample is not None or bool(e.model_cards))
            for e in self.order
        )

    def ready(self) -> bool:
        """At least --min-ready-endpoints endpoints take traffic (/readyz)."""
        return self.ready_count() >= self.cfg.min_ready_endpoints

    def not_serving(self) -> str | None:
        """Why a request would not be served now (--serving-health), or None: an endpoint takes traffic and
        its models are known (so /v1/models lists what a client may ask for)."""
        if not self.order:
            return "no endpoint is known yet"
        for e in self.order:
            if e.healthy and e.routable and not e.draining and (e.model_cards or e.models):
                return None
        states = ", ".join(f"{e.url} {e.state()}" + ("" if e.models else " (models not known yet)")
                           for e in self.order[:8])
        return f"no endpoint serves yet: {states}"

    def live_rows(self) -> Iterable[tuple[str, int, bool, float]]:
        now = self.loop.time()
        for ep in self.order:
            age = now - ep.sample_at if ep.sample is not None else math.inf
            ok = ep.healthy and ep.routable and not ep.draining
            yield ep.url, self.shared.totals(ep.slot).inflight, ok, age

    def models(self) -> list[dict[str, object]]:
        """The union of the endpoints' model cards (/v1/models)."""
        seen: dict[str, dict[str, object]] = {}
        for ep in self.order:
            for card in ep.model_cards:
                seen.setdefault(str(card.get("id")), card)
            for name in ep.models:
                seen.setdefault(name, {"id": name, "object": "model", "owned_by": "lbd"})
        return list(seen.values())

    def status(self) -> list[dict[str, object]]:
        now = self.loop.time()
        out = []
        for ep in self.order:
            snap = ep.snapshot(self.shared, now)
            out.append(
                {
                    "url": ep.url,
                    "rank": ep.rank,
                    "state": ep.state(),
                    "source": ep.source,
                    "models": sorted(ep.models),
                    "inflight": snap.inflight,
                    "running": snap.running,
                    "waiting": snap.waiting,
                    "kv_usage": snap.kv_usage,
                    "delta": snap.delta,
                    "scrape_age_s": None if math.isinf(snap.age_s) else round(snap.age_s, 3),
                    "telemetry": ep.telemetry_path,
                    "failures": ep.failures,
                    "last_error": ep.last_error or None,
                    "kv_events": self.exact.status(ep.url) if self.exact is not None else {"mode": "off"},
                    "telemetry_push": self.push.status(ep.url) if self.push is not None else None,
                }
            )
        return out
