"""The router's shared state: its endpoints (``lbd.router.endpoints.Fleet``, the one owner of what the router
knows of an endpoint, which this class extends) and the parts every request step uses: the policy, one pool
of upstream connections per endpoint, the exact KV view, the pushed load feed, the metrics. Besides wiring
those to the fleet's events, it samples the endpoints one decision looks at (``snapshots_for``) and reports
(readiness, /v1/models, /router/status); it changes no endpoint itself."""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterable
from typing import TYPE_CHECKING

from lbd.common.tls import client_context
from lbd.policies import EndpointSnapshot, Policy, RequestFacts, make_policy
from lbd.policies.sample import SAMPLE_ABOVE, SAMPLE_K, holder_keys, sample_indices
from lbd.router.config import RouterConfig
from lbd.router.endpoints import Endpoint, Fleet
from lbd.router.kv.view import ExactView
from lbd.router.metrics import RouterMetrics
from lbd.router.outlier import Outliers
from lbd.router.shared import SharedCounters
from lbd.router.upstream import UpstreamPool

if TYPE_CHECKING:
    from lbd.router.load_feed import LoadFeed

log = logging.getLogger("lbd.router")


class RouterState(Fleet):
    """The fleet of endpoints plus what every request step shares (see the module's docstring): one per
    router worker."""

    def __init__(self, cfg: RouterConfig, shared: SharedCounters) -> None:
        super().__init__(shared, RouterMetrics(self.live_rows, self.kv_rows, self.push_rows),
                         failure_threshold=cfg.health_failure_threshold,
                         consecutive_5xx=cfg.outlier_consecutive_5xx,
                         max_ejection_percent=cfg.outlier_max_ejection_percent)
        self.cfg = cfg
        # verifies https:// upstreams against --ssl-ca-certs (else the system's trust store)
        self.tls = client_context(cfg.ssl_ca_certs)
        self.pools: dict[str, UpstreamPool] = {}
        self.policy: Policy = make_policy(
            cfg.policy,
            stale_s=cfg.stale_after_s,
            seed=shared.worker,
            prefill_tokens_per_s=cfg.prefill_tokens_per_s,
            evict_weight=cfg.evict_weight,
            lora_max_replicas=cfg.lora_max_replicas,
        )
        self.exact: ExactView | None = None  # set by the app when --kv-events is not off
        self.push: LoadFeed | None = None  # set by the monitor unless --telemetry-push off
        self.outliers = Outliers(self, cfg.outlier_first_byte_timeout_s, cfg.outlier_ejection_s)
        self._rng = random.Random(shared.worker)  # the decision's sample (snapshots_for)
        # first in line: a pool exists before the monitor hears of the endpoint
        self.on_added.append(self._open_pool)
        self.on_removed.append(self._removed)
        self.on_readmitted.append(self._forget)
        self.on_restarted.append(self._restarted)

    def _open_pool(self, ep: Endpoint) -> None:
        self.pools[ep.url] = UpstreamPool(ep.url, self.cfg.connect_timeout_s, self.tls)

    def _removed(self, ep: Endpoint) -> None:
        self.policy.forget(ep.url)
        pool = self.pools.pop(ep.url, None)
        if pool is not None:
            pool.close()

    def _forget(self, ep: Endpoint) -> None:
        """Nothing ``ep`` held is known to be cached (a re-admission: it may be a new process)."""
        self.policy.forget(ep.url)

    def _restarted(self, ep: Endpoint, why: str) -> None:
        self.policy.forget(ep.url)
        if self.exact is not None:
            self.exact.restarted(ep.url, why)

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
        return [self.snapshot(ep, now) for ep in picked.values()]

    def push_rows(self) -> Iterable[tuple[str, float, bool]]:
        return self.push.rows() if self.push is not None else ()

    def kv_rows(self) -> list[tuple[str, float, float, int]]:
        return self.exact.metric_rows() if self.exact is not None else []

    def ready_count(self) -> int:
        """Endpoints that take traffic and have answered us (a scrape or their model list)."""
        return sum(e.takes_traffic() and (e.sample is not None or bool(e.model_cards)) for e in self.order)

    def ready_needed(self) -> int:
        """--min-ready-endpoints, capped at the endpoints the router knows (at least 1): a fleet resized below
        the flag (``lbd scale``, ``lbd serve --autoscale``) is ready once every endpoint it still has is."""
        return max(1, min(self.cfg.min_ready_endpoints, len(self.order)))

    def ready(self) -> bool:
        """At least ``ready_needed()`` endpoints take traffic (/readyz)."""
        return self.ready_count() >= self.ready_needed()

    def not_serving(self) -> str | None:
        """Why a request would not be served now (--serving-health), or None: an endpoint takes traffic and
        its models are known (so /v1/models lists what a client may ask for)."""
        if not self.order:
            return "no endpoint is known yet"
        for e in self.order:
            if e.takes_traffic() and (e.model_cards or e.models):
                return None
        states = ", ".join(f"{e.url} {e.state()}" + ("" if e.models else " (models not known yet)")
                           for e in self.order[:8])
        return f"no endpoint serves yet: {states}"

    def live_rows(self) -> Iterable[tuple[str, int, bool, float]]:
        now = self.loop.time()
        for ep in self.order:
            age = now - ep.sample_at if ep.sample is not None else math.inf
            ok = ep.takes_traffic()
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
            snap = self.snapshot(ep, now)
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
