"""Prefill/decode disaggregation in the router: a request's two halves on two ranks (vLLM's contract).

With prefill and decode ranks (``--prefill URL`` / ``--decode URL``, vllm-router's flags, or roles read from
supervisors' /status: the endpoint snapshot's ``role``), a chat or completion request first goes to a prefill
rank as vLLM's disaggregation proxy sends it (``kv_transfer_params`` with ``do_remote_decode``, ``max_tokens``
1, not streamed); the ``kv_transfer_params`` of that answer go into the decode stage's body, which then runs
the usual way (decide, retries, streaming relay): the decode rank pulls the blocks it lacks and streams the
answer.

P/D is two profiles run by the one decision entry (``lbd.policies.route``): the prefill stage by the prefill
profile (``pd_prefill``: the ``prefill_work`` scorer, least prefill work ahead: this router's stages without
a first byte there plus the prompt's tokens not cached there, then the scraped backlog), the decode stage by
the router's own policy; each behind the gate plus its role as a rule (``lbd.policies.roles``). What this
step settles is one frozen ``PdStage`` on the request: the decode stage's gate, its body, the answer's header.
A prefill stage is counted on its rank like any dispatch (shared counters, every router worker), because a
rank busy with one long prefill step reports no queue until the step ends.

The request runs whole on one rank (colocated) when a role has no ready rank, when the prompt is estimated
shorter than ``--pd-min-prompt-tokens`` (moving its KV costs more than it saves: it then runs on a decode
rank, as conditional disaggregation does, so the prefill ranks stay free for long prompts), when it is
pinned to a rank, when the prefill stage fails, or when the prefill rank lent no blocks (its lease cap was
reached, or the prompt fills no block: the decode rank would recompute it all, so it gets the plain request).
The answer's ``x-lbd-disagg`` header says which it was: ``pd <prefill rank>`` or ``colocated (<reason>)``.
A decode rank whose pull fails (a lease that expired) recomputes the prompt and says nothing in its answer:
that case still reads ``pd``. With ``--debug-headers`` the answer also names the prefill rank and the plugin
that chose it (``x-lbd-prefill-endpoint``, ``x-lbd-prefill-route-reason``).

Trust: ``kv_transfer_params`` are the router's own. A client's are refused at admission (400,
``lbd.router.admission``), so no client steers a rank's leases or pulls through the router; the params a
prefill rank answers are signed by it, and the decode rank pulls only for params its key verifies
(``lbd.engine.kv_transfer.trust``; ARCHITECTURE.md, "P/D trust model").
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import orjson

from lbd.common.limits import read_upstream
from lbd.policies import Decision, Filter, Refusal, make_policy, route
from lbd.policies.filters import GATE
from lbd.policies.registry import prefill_profile
from lbd.policies.roles import has_role, stage_gate
from lbd.router.continuation import append_field
from lbd.router.messages import serialize_headers
from lbd.router.routed import PdStage, RoutedRequest

if TYPE_CHECKING:
    from lbd.router.endpoints import Endpoint
    from lbd.router.state import RouterState

logger = logging.getLogger(__name__)

PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_PREFILL_ANSWER_BYTES = 1 << 20
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
PREFILL, DECODE = stage_gate("prefill"), stage_gate("decode")


def with_params(body: bytes, params: dict[str, Any]) -> bytes:
    """The JSON object ``body`` with ``kv_transfer_params`` added last, its other bytes as they were: what
    earlier steps added stays (the migrator's ``return_token_ids``, without which a broken decode stream could
    not move; the router's forwarded prompt ids)."""
    spliced = append_field(body, b'"kv_transfer_params":' + orjson.dumps(params))
    if spliced is None:
        raise ValueError("the request body is not a JSON object")
    return spliced


class Disagg:
    """The two-stage protocol over the router's own upstream pools."""

    def __init__(self, state: RouterState) -> None:
        self.state = state
        cfg = state.cfg
        self.flagged = {url: "prefill" for url in cfg.prefill} | {url: "decode" for url in cfg.decode}
        self.min_prompt_tokens = cfg.pd_min_prompt_tokens
        self.timeout_s = cfg.pd_prefill_timeout_s
        self.debug_headers = cfg.debug_headers
        self.prefill = make_policy(prefill_profile(cfg.policy), stale_s=cfg.stale_after_s,
                                   seed=state.shared.worker)
        for ep in state.endpoints.values():
            self._flag_role(ep)
        state.on_added.append(self._flag_role)

    def _flag_role(self, ep: Endpoint) -> None:
        """--prefill/--decode give their endpoints a role (else a supervisor's /status does)."""
        role = self.flagged.get(ep.url)
        if role is not None:
            self.state.set_role(ep, role)

    async def prepare(self, rr: RoutedRequest) -> None:
        """Run the prefill stage when it pays; ``rr.pd`` says how the decode stage runs (on a decode rank with
        the prefill's params, or colocated: on any rank, or a decode rank)."""
        request, data = rr.request, rr.data
        if request.method != "POST" or request.path not in PATHS or not isinstance(data, dict):
            return
        pd = rr.pd = await self._stage(rr, data)
        if rr.trace is not None:
            rr.trace.span.set_attribute("lbd.disagg", pd.outcome)

    async def _stage(self, rr: RoutedRequest, data: dict[str, Any]) -> PdStage:
        if data.get("kv_transfer_params") is not None:  # refused at admission: never forwarded
            return self._colocated("client_params")
        if (data.get("n") or 1) != 1:
            return self._colocated("n")
        facts = rr.facts
        if facts.pinned_rank is not None:  # the client chose the rank
            return self._colocated("pinned")
        snaps = self.state.snapshots()
        for role in ("prefill", "decode"):
            if not has_role(snaps, role, facts.model):
                return self._colocated(f"no_{role}_rank")
        if facts.prompt_tokens < self.min_prompt_tokens:
            # a short prompt runs whole on a decode rank: the prefill ranks stay free for long prompts
            return self._colocated("short_prompt", DECODE)
        failed: list[str] = []
        for _ in range(2):  # a failed prefill stage is tried once more elsewhere
            d = route(self.prefill, facts, snaps, failed, False, PREFILL)
            if isinstance(d, Refusal):
                break
            params = await self._counted(rr, d, data)
            if params is not None:
                return self._pd(rr, d, params)
            failed.append(d.endpoint.key)
            snaps = self.state.snapshots()
        return self._colocated("prefill_failed")

    async def _counted(self, rr: RoutedRequest, d: Decision, data: dict[str, Any]) -> dict[str, Any] | None:
        """The prefill stage on ``d``'s rank, counted there until it answers (its uncached tokens: what the
        ``prefill_work`` scorer reads back as that rank's work ahead)."""
        state = self.state
        ep = state.endpoints.get(d.endpoint.key)
        if ep is None:
            return None
        charge = int(self.prefill.charge_tokens(rr.facts, d.endpoint))
        state.shared.dispatch(ep.slot, charge)
        state.metrics.dispatched(self.prefill.name, d.reason, state.loop.time() - rr.t0)
        if rr.trace is not None:
            rr.trace.span.set_attributes({"lbd.pd.prefill_endpoint": ep.url,
                                          "lbd.pd.prefill_reason": d.reason,
                                          "lbd.pd.prefill_plugin": d.plugin})
        try:
            return await self._prefill(rr, ep.url, data)
        finally:
            state.shared.start(ep.slot, charge)
            state.shared.finish(ep.slot)

    def _pd(self, rr: RoutedRequest, d: Decision, params: dict[str, Any]) -> PdStage:
        """The decode stage after a prefill on ``d``'s rank: on a decode rank with the prefill's params; or,
        when the prefill rank lent no blocks, colocated on a decode rank (``no_lease``: it recomputes)."""
        extra = b""
        if self.debug_headers:
            extra = serialize_headers((("x-lbd-prefill-endpoint", d.endpoint.key),
                                       ("x-lbd-prefill-route-reason", d.line())))
        if not params.get("remote_block_ids"):
            return self._colocated("no_lease", DECODE, extra, d)
        self.state.metrics.decision("pd", "pd")
        outcome = f"pd {d.endpoint.key}"
        header = b"x-lbd-disagg: %s\r\n%s" % (outcome.encode("latin-1"), extra)
        return PdStage(outcome, header, DECODE, with_params(rr.own_body, params), d)

    def _colocated(self, reason: str, gate: tuple[Filter, ...] = GATE, extra: bytes = b"",
                   prefill: Decision | None = None) -> PdStage:
        """The request runs whole on one rank (of any role, or behind ``gate``)."""
        self.state.metrics.decision("pd", f"colocated_{reason}")
        outcome = f"colocated ({reason})"
        return PdStage(outcome, b"x-lbd-disagg: %s\r\n%s" % (outcome.encode(), extra), gate, None, prefill)

    async def _prefill(self, rr: RoutedRequest, key: str, data: dict[str, Any]) -> dict[str, Any] | None:
        """The prefill stage on ``key``: vLLM's proxy's first request; the answer's ``kv_transfer_params``."""
        pool = self.state.pools.get(key)
        if pool is None:
            return None
        first = {**data, "kv_transfer_params": PREFILL_PARAMS, "stream": False, "max_tokens": 1}
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        first.pop("stream_options", None)
        upstream = None
        try:
            upstream = await pool.request("POST", rr.request.raw_path, rr.headers, orjson.dumps(first),
                                          self.timeout_s)
            body = await read_upstream(upstream, MAX_PREFILL_ANSWER_BYTES, self.timeout_s, f"{key}'s prefill")
        except Exception as e:  # any failure of the first stage (connect, timeout, protocol): colocated
            logger.warning("prefill stage on %s failed (%s): running the request colocated", key, e)
            return None
        finally:
            if upstream is not None:
                upstream.release()
        if upstream.status != 200:
            logger.warning("prefill stage on %s answered %d: running the request colocated", key,
                           upstream.status)
            return None
        try:
            params = orjson.loads(body).get("kv_transfer_params")
        except (orjson.JSONDecodeError, AttributeError):
            return None
        return params if isinstance(params, dict) and params.get("do_remote_prefill") else None
