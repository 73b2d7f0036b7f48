"""Prefill/decode disaggregation in the router: a request's two halves on two ranks (vLLM's contract).

With prefill and decode ranks (``--prefill URL`` / ``--decode URL``, vllm-router's flags, or roles read from
supervisors' /status), a chat or completion request first goes to a prefill rank as vLLM's disaggregation
proxy sends it (``kv_transfer_params`` with ``do_remote_decode``, ``max_tokens`` 1, not streamed); the
``kv_transfer_params`` of that answer go into the request, which then runs the usual way (policy, retries,
streaming relay) over the decode ranks only: the decode rank pulls the blocks it lacks and streams the
answer. The prefill rank is the one with the least prefill work ahead of the prompt's: the prompt tokens of
this router's prefill stages running there plus the prompt's tokens not cached there (the exact view's cached
tokens), then the scraped backlog. The stages are counted here because a rank busy with one long prefill step
reports no queue until the step ends. The decode rank is the policy's pick among the decode ranks (KV room,
load).

The request runs whole on one rank (colocated) when a role has no ready rank, when the prompt is estimated
shorter than ``--pd-min-prompt-tokens`` (moving its KV costs more than it saves: it then runs on a decode
rank, as conditional disaggregation does, so the prefill ranks stay free for long prompts), or when the
prefill stage fails. The answer's ``x-lbd-disagg`` header says which it was: ``pd <prefill rank>`` or
``colocated (<reason>)``.

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
from lbd.policies import EndpointSnapshot
from lbd.router.continuation import append_field
from lbd.router.routed import RoutedRequest

if TYPE_CHECKING:
    from lbd.router.state import RouterState

logger = logging.getLogger(__name__)

PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_PREFILL_ANSWER_BYTES = 1 << 20
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


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
        self.prefill_urls = frozenset(cfg.prefill)
        self.decode_urls = frozenset(cfg.decode)
        self.min_prompt_tokens = cfg.pd_min_prompt_tokens
        self.timeout_s = cfg.pd_prefill_timeout_s
        self.prefilling: dict[str, int] = {}  # prefill rank -> prompt tokens of its stages in flight

    def roles(self, snaps: list[EndpointSnapshot]) -> tuple[list[EndpointSnapshot], list[EndpointSnapshot]]:
        """The ready prefill and decode ranks: by flag, or by the role a supervisor's /status gave them."""
        eps = self.state.endpoints
        prefill, decode = [], []
        for s in snaps:
            if not s.healthy or s.draining:
                continue
            role = getattr(eps.get(s.key), "role", "mixed")
            if s.key in self.prefill_urls or role == "prefill":
                prefill.append(s)
            elif s.key in self.decode_urls or role == "decode":
                decode.append(s)
        return prefill, decode

    async def prepare(self, rr: RoutedRequest) -> None:
        """Run the prefill stage when it pays; leaves ``rr`` for the decode stage (its body carries the
        params, ``pd_exclude`` keeps it off non-decode ranks), or as it was for a colocated run."""
        request, data = rr.request, rr.data
        if request.method != "POST" or request.path not in PATHS or not isinstance(data, dict):
            return
        if data.get("kv_transfer_params") is not None:  # refused at admission: never forwarded
            return self._colocated(rr, "client_params")
        if (data.get("n") or 1) != 1:
            return self._colocated(rr, "n")
        snaps = self.state.snapshots()
        prefill, decode = self.roles(snaps)
        model = rr.facts.model
        prefill = [s for s in prefill if s.serves(model)]
        decode = [s for s in decode if s.serves(model)]
        if not prefill or not decode:
            return self._colocated(rr, "no_prefill_rank" if not prefill else "no_decode_rank")
        if rr.facts.prompt_tokens < self.min_prompt_tokens:
            # a short prompt runs whole on a decode rank: the prefill ranks stay free for long prompts
            keep = {s.key for s in decode}
            rr.pd_exclude = [s.key for s in snaps if s.key not in keep]
            return self._colocated(rr, "short_prompt")
        params = None
        for _ in range(min(2, len(prefill))):  # a failed prefill stage is tried once more elsewhere
            target = self.pick_prefill(rr, prefill)
            tokens = rr.facts.prompt_tokens
            self.prefilling[target.key] = self.prefilling.get(target.key, 0) + tokens
            try:
                params = await self._prefill(rr, target.key, data)
            finally:
                self.prefilling[target.key] -= tokens
            if params is not None:
                break
            prefill.remove(target)
        if params is None:
            return self._colocated(rr, "prefill_failed")
        rr.body = with_params(rr.body, params)
        keep = {s.key for s in decode}
        rr.pd_exclude = [s.key for s in snaps if s.key not in keep]
        rr.rid_header += b"x-lbd-disagg: pd %s\r\n" % target.key.encode("latin-1")
        self.state.metrics.decision("pd", "pd")

    def pick_prefill(self, rr: RoutedRequest, ranks: list[EndpointSnapshot]) -> EndpointSnapshot:
        """The least prefill work ahead: tokens of stages in flight there plus the prompt's uncached tokens;
        then the scraped backlog, then fewest in flight."""
        cached = rr.facts.cached_tokens or {}
        need = rr.facts.prompt_tokens
        return min(ranks, key=lambda s: (self.prefilling.get(s.key, 0) + need - cached.get(s.key, 0),
                                         s.unstarted_tokens + s.waiting, s.inflight))

    def _colocated(self, rr: RoutedRequest, reason: str) -> None:
        rr.rid_header += b"x-lbd-disagg: colocated (%s)\r\n" % reason.encode()
        self.state.metrics.decision("pd", f"colocated_{reason}")

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
