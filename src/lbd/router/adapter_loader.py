"""LoRA adapters loaded on demand (issue 44): ``lbd route --lora-modules name=path ...`` names the adapters
the fleet may load (the engine's syntax, ``lbd.common.lora_modules``; each path as the ranks see it).

- **Which ranks may take one** (``widen``). For a request whose ``model`` is such an adapter, every rank that
  serves LoRA (its residency view reports slots, ``LoraView.max_loras``) and does not list the adapter is
  shown to the policy as one that could serve it: its snapshot, copied for this decision, lists the adapter in
  its models and its ``LoraView.known``. The gate then lets the request through and the policy picks among
  those ranks by its own rules: under ``predicted_ttft`` the adapter scorer's (a rank holding it on device,
  then in CPU, then a free slot, then an evictable one; the adapter's rendezvous home;
  ``--lora-max-replicas``). An adapter no rank lists and the router does not know keeps the gate's 404 (vLLM's
  answer).
- **The load** (``prepare``, between the decision and the attempt). When the chosen rank does not list the
  adapter, the router calls its ``POST /v1/load_lora_adapter`` (vLLM's body, with the key the router sends the
  ranks, ``--upstream-api-key``) and sends the request once it answered. Concurrent requests for one adapter
  on one rank share one load (a shielded task: a client that leaves does not cancel the others' load); a rank
  that answers that it already holds it (another router worker loaded it) counts as loaded. A failed load
  answers the client at once, not retried elsewhere: the rank's 400 (the adapter refused: bad folder,
  unsupported module) as it is, anything else (no runtime loading on the rank, a missing folder, no answer) as
  502, with the rank's reason. ``x-lbd-route-reason`` reads ``adapter_loaded (<plugin>): ...``.
- A rank lists a loaded adapter in its telemetry only once a request used it; until then, for ``REMEMBER_S``
  or until the rank restarts or leaves, the router remembers its own loads there and does not load again. A
  rank that restarts forgets what the router loaded (the supervisor restores only the node's adapters,
  ``lbd.supervisor.adapters``); the next request for it loads it again.
- **Listing** (``cards``, the router's ``/v1/models``). vLLM lists a loaded adapter with ``parent``; the
  router also lists each ``--lora-modules`` adapter no rank lists yet, the same way: ``root`` its path as
  the ranks see it, ``parent`` its ``base_model_name`` or else the base model of a LoRA rank. It is listed
  while at least one rank that takes traffic serves LoRA (reports slots), since a request for it may then
  be served; once a rank has it loaded, that rank's own card is listed instead (never twice). Whether a
  rank allows runtime loading (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) is not visible from outside: a listed
  adapter whose load the rank refuses answers 502 with the rank's reason.
- ``lbd_router_adapter_loads_total{endpoint, outcome}`` counts the loads (of every worker): ``loaded``,
  ``held`` (the rank had it already), ``failed``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import orjson
from prometheus_client import Counter

from lbd.common.limits import PeerReadTooLarge, read_upstream
from lbd.common.lora_modules import LoraModule
from lbd.policies import Decision, EndpointSnapshot, RequestFacts
from lbd.router.routed import Failure
from lbd.router.upstream import UpstreamError

if TYPE_CHECKING:
    from lbd.router.endpoints import Endpoint
    from lbd.router.routed import RoutedRequest
    from lbd.router.state import RouterState

LOAD_PATH = "/v1/load_lora_adapter"
REMEMBER_S = 30.0  # a load of ours counts as resident this long, or until the rank shows it
ANSWER_CAP = 65536  # bytes of a rank's answer to a load that are read


class AdapterLoader:
    """The adapters the router may load, and the loads under way or done (one per router worker)."""

    def __init__(self, state: RouterState, modules: tuple[LoraModule, ...], auth: bytes) -> None:
        self.state = state
        self.catalog = {m.name: m for m in modules}
        self._head = b"Content-Type: application/json\r\n" + auth
        self._loads: dict[tuple[str, str], asyncio.Future[Failure | float]] = {}  # (endpoint, adapter)
        self._loaded: dict[tuple[str, str], float] = {}  # -> when our load there finished (loop time)
        # in a multiprocess registry (--workers > 1) every worker's counts are summed on /metrics by itself
        self.loads = Counter("lbd_router_adapter_loads", "LoRA adapter loads the router asked ranks for, by "
                             "outcome (loaded, held: it was there already, failed).", ["endpoint", "outcome"],
                             registry=None)
        if not state.metrics.multiprocess:
            state.metrics.register(self.loads)
        state.on_removed.append(self._forget)
        state.on_restarted.append(lambda ep, why: self._forget(ep))
        state.on_readmitted.append(self._forget)

    # ---- decide -------------------------------------------------------------------------------------------
    def widen(self, facts: RequestFacts, snaps: list[EndpointSnapshot]) -> list[EndpointSnapshot]:
        """``snaps`` with every LoRA rank able to take the request's adapter (see the module's docstring);
        the same list, untouched, for any other request."""
        name = facts.model
        if name is None or name not in self.catalog:
            return snaps
        out = []
        for e in snaps:
            view = e.lora
            if view is None or view.max_loras <= 0 or (name in view.known and e.serves(name)):
                out.append(e)
                continue
            models = e.models | {name} if e.models else e.models
            out.append(replace(e, models=models, lora=replace(view, known=view.known | {name})))
        return out

    # ---- /v1/models ----------------------------------------------------------------------------------------
    def cards(self, listed: list[dict[str, object]]) -> list[dict[str, object]]:
        """Model cards of the adapters the router may load that ``listed`` (the ranks' cards) lacks; none
        while no rank that takes traffic serves LoRA (see the module's docstring)."""
        base = None
        for ep in self.state.order:
            view = self.state.snapshot(ep).lora
            if ep.takes_traffic() and view is not None and view.max_loras > 0:
                base = next((str(c["id"]) for c in ep.model_cards if c.get("parent") is None), None)
                break
        else:
            return []
        have = {c.get("id") for c in listed}
        return [{"id": m.name, "object": "model", "created": int(time.time()), "owned_by": "lbd",
                 "root": m.path, "parent": m.base_model_name or base, "max_model_len": None, "permission": []}
                for m in self.catalog.values() if m.name not in have]

    # ---- between the decision and the attempt --------------------------------------------------------------
    async def prepare(self, rr: RoutedRequest, d: Decision) -> Failure | None:
        """Load the request's adapter on ``d``'s rank unless it is there; a Failure when the load failed."""
        module = self.catalog.get(rr.facts.model or "")
        ep = self.state.endpoints.get(d.endpoint.key)
        if module is None or ep is None or self._holds(ep, module.name):
            return None
        pair = (ep.url, module.name)
        task = self._loads.get(pair)
        if task is None:
            task = self._loads[pair] = asyncio.ensure_future(self._load(ep, module))
            task.add_done_callback(lambda _: self._loads.pop(pair, None))
        got = await asyncio.shield(task)
        if isinstance(got, Failure):
            return got
        d.reason = "adapter_loaded"
        d.detail = f"adapter {module.name} loaded on demand on {ep.url} ({got:.2f} s to load; " \
                   f"--lora-modules path {module.path})"
        return None

    def _holds(self, ep: Endpoint, name: str) -> bool:
        """The rank lists ``name`` (its models or its residency), or our load there is recent."""
        snap = self.state.snapshot(ep)
        if name in snap.models or snap.lora is not None and name in snap.lora.known:
            return True
        at = self._loaded.get((ep.url, name))
        return at is not None and self.state.loop.time() - at < REMEMBER_S

    async def _load(self, ep: Endpoint, module: LoraModule) -> Failure | float:
        """One load on ``ep``: the seconds it took, or the client's answer when it failed."""
        loop = self.state.loop
        t0 = loop.time()
        body = orjson.dumps({"lora_name": module.name, "lora_path": module.path})
        timeout = self.state.cfg.response_timeout_s
        try:
            upstream = await self.state.pools[ep.url].request("POST", LOAD_PATH, self._head, body, timeout)
            try:
                text = await read_upstream(upstream, ANSWER_CAP, timeout, f"{ep.url}'s answer to a load")
            finally:
                upstream.close()
        except (UpstreamError, OSError, PeerReadTooLarge, KeyError) as e:  # (TimeoutError is an OSError)
            self.loads.labels(ep.url, "failed").inc()
            return _failed(module.name, ep.url, 502, f"no answer: {e or type(e).__name__}")
        message = _message(text)
        held = upstream.status == 400 and "already been loaded" in message
        self.loads.labels(ep.url, "held" if held else "loaded" if upstream.status == 200 else "failed").inc()
        if upstream.status == 200 or held:
            self._loaded[(ep.url, module.name)] = loop.time()
            return loop.time() - t0
        return _failed(module.name, ep.url, 400 if upstream.status == 400 else 502,
                       f"{upstream.status}: {message}")

    def _forget(self, ep: Endpoint) -> None:
        for pair in [p for p in self._loaded if p[0] == ep.url]:
            del self._loaded[pair]


def _failed(name: str, url: str, status: int, why: str) -> Failure:
    kind = "BadRequestError" if status == 400 else "BadGatewayError"
    body = orjson.dumps({"error": {"message": f"loading LoRA adapter '{name}' on {url} failed: {why}",
                                   "type": kind, "param": "model", "code": status}})
    return Failure(status, why, "adapter_load", False, body)


def _message(text: bytes) -> str:
    """An OpenAI-style error's message, else the answer's first line (shortened)."""
    try:
        message = str(orjson.loads(text)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = text.decode("utf-8", "replace").strip().split("\n", 1)[0]
    return message if len(message) <= 300 else message[:297] + "..."
