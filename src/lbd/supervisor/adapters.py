"""LoRA adapters given once for the node (issue 44): loaded on every rank, and again on a rank that restarts.

- ``--lora-modules`` given to ``lbd supervise`` is an engine flag: every rank gets it on its command line, so
  a restarted rank serves those adapters again with nothing done here.
- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path", ...}`` and ``POST /v1/unload_lora_adapter``
  ``{"lora_name"}`` on the health port (vLLM's bodies; behind vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``
  gate, which the ranks inherit, and the admin token of the other admin endpoints) go to every ready rank at
  once and are remembered: the node's adapters are this module's list. The answer is 200 with each rank's
  answer when every ready rank holds the adapter (one that already had it counts), else the first refusal's
  status (a rank's 4xx, or 502 for a rank that failed, refused the supervisor's key or could not be reached)
  naming each rank's reason. A load is remembered unless every ready rank refused it; an unload forgets at
  once.
- A rank that starts again (a crash, ``/ranks/{rank}/restart``, a rolling restart) gets every remembered
  adapter loaded back *before* it is marked ready (``RankWorker.before_ready``): routers see it routable only
  with the node's adapters in place. The start-up timeout still bounds it; an adapter that no longer loads
  is logged and left out (the rank serves the rest, and routers see it does not list that one).
- Adapters loaded directly on one rank (its own ``/v1/load_lora_adapter``, or a router's on-demand load) are
  that rank's own business: not remembered here, gone when it restarts.

Commands run one at a time (a lock), so a load and an unload of one name never cross. A rank that becomes
ready while a command runs is covered either way: the command is in the list before the ready ranks are
chosen, and a restoring rank reads the list again until it is the one it has loaded.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from lbd.common.limits import PeerReadTooLarge, read_aiohttp
from lbd.common.lora_modules import RUNTIME_ENV, runtime_updates_allowed
from lbd.wire.states import RankState

if TYPE_CHECKING:
    from lbd.supervisor.rank import RankWorker

log = logging.getLogger("lbd.supervisor")

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
CALL_TIMEOUT_S = 120.0  # one rank's load (a read from disk) or unload
Denied = Callable[[web.Request], "web.Response | None"]  # the health port's admin check


@dataclass(slots=True, frozen=True)
class RankAnswer:
    """One rank's answer to a load or unload (status 0: no answer; ``message`` says why)."""

    rank: int
    status: int
    message: str

    def held(self, unload: bool) -> bool:
        """The rank ends in the wanted state: loaded (or already had it), unloaded (or never had it)."""
        if unload:
            return self.status in (200, 404)
        return self.status == 200 or self.status == 400 and "already been loaded" in self.message


class NodeAdapters:
    """The node's remembered adapters and the fan-out of their loads and unloads to its ranks."""

    def __init__(self, workers: list[RankWorker], api_key: str | None, tls: ssl.SSLContext | None) -> None:
        self.workers = workers
        self.remembered: dict[str, dict[str, Any]] = {}  # lora_name -> the load body the ranks get
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._tls = tls
        self._lock = asyncio.Lock()

    # ---- the health port's commands ---------------------------------------------------------------------
    async def load(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        name = body["lora_name"]
        async with self._lock:
            self.remembered[name] = body  # first: a rank getting ready now restores it (see the docstring)
            answers = await self._each_ready(LOAD, body)
            if answers and not any(a.held(False) for a in answers):
                del self.remembered[name]
        return _outcome(name, answers, False, name in self.remembered)

    async def unload(self, name: str) -> tuple[int, dict[str, Any]]:
        async with self._lock:
            known = self.remembered.pop(name, None) is not None
            answers = await self._each_ready(UNLOAD, {"lora_name": name})
        if not known and not any(a.status == 200 for a in answers):
            return 404, _error(404, f"The lora adapter '{name}' cannot be found on this node.")
        return _outcome(name, answers, True, False)

    # ---- a rank starting again -----------------------------------------------------------------------------
    async def restore(self, worker: RankWorker) -> None:
        """``RankWorker.before_ready``: load every remembered adapter on ``worker``'s new process; read the
        list again until nothing is left to do (a command may change it meanwhile)."""
        if not self.remembered:
            return
        done: dict[str, dict[str, Any]] = {}  # name -> the body tried
        async with self._session() as session:
            while True:
                todo = {n: b for n, b in self.remembered.items() if done.get(n) is not b}
                gone = [n for n in done if n not in self.remembered]
                if not todo and not gone:
                    return
                for name, body in todo.items():
                    a = await self._call(session, worker, LOAD, body)
                    done[name] = body
                    if not a.held(False):
                        log.warning("rank %d: adapter %s not restored: %s", a.rank, name, a.message)
                for name in gone:
                    await self._call(session, worker, UNLOAD, {"lora_name": name})
                    del done[name]
                log.info("rank %d: %d node adapter(s) restored", worker.spec.rank, len(done))

    # ---- HTTP ---------------------------------------------------------------------------------------------
    def _session(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(ssl=self._tls or True, limit=0)
        return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S))

    async def _each_ready(self, path: str, body: dict[str, Any]) -> list[RankAnswer]:
        ready = [w for w in self.workers if w.state is RankState.READY]
        async with self._session() as session:
            return list(await asyncio.gather(*(self._call(session, w, path, body) for w in ready)))

    async def _call(self, session: aiohttp.ClientSession, worker: RankWorker, path: str,
                    body: dict[str, Any]) -> RankAnswer:
        rank = worker.spec.rank
        try:
            async with session.post(worker.spec.probe_url + path, json=body, headers=self._headers) as resp:
                text = (await read_aiohttp(resp, 65536)).decode("utf-8", "replace")
                return RankAnswer(rank, resp.status, _message(text))
        except (aiohttp.ClientError, OSError, TimeoutError, PeerReadTooLarge) as e:
            return RankAnswer(rank, 0, f"no answer: {e or type(e).__name__}")

    # ---- routes --------------------------------------------------------------------------------------------
    def routes(self, denied: Denied) -> list[web.RouteDef]:
        """The two POST routes, each checked by vLLM's gate, then ``denied`` (the admin token)."""

        def guarded(handler: Callable[[dict[str, Any]], Awaitable[web.Response]]) -> Any:
            async def route(request: web.Request) -> web.Response:
                if not runtime_updates_allowed():
                    why = f"runtime adapter updates are off: start lbd supervise with {RUNTIME_ENV}=1"
                    return _json(404, _error(404, f"{request.path}: {why} (its ranks inherit it)"))
                refused = denied(request)
                if refused is not None:
                    return refused
                try:
                    body = orjson.loads(await request.read())
                except orjson.JSONDecodeError:
                    body = None
                if not isinstance(body, dict):
                    return _json(400, _error(400, "the body must be a JSON object"))
                return await handler(body)
            return route

        return [web.post(LOAD, guarded(self._load_route)), web.post(UNLOAD, guarded(self._unload_route))]

    async def _load_route(self, body: dict[str, Any]) -> web.Response:
        if not _named(body, "lora_name") or not _named(body, "lora_path"):
            return _json(400, _error(400, "Both 'lora_name' and 'lora_path' must be provided."))
        return _json(*await self.load(body))

    async def _unload_route(self, body: dict[str, Any]) -> web.Response:
        if not _named(body, "lora_name"):
            return _json(400, _error(400, "'lora_name' needs to be provided to unload a LoRA adapter."))
        return _json(*await self.unload(body["lora_name"]))


def _outcome(name: str, answers: list[RankAnswer], unload: bool, remembered: bool) -> tuple[int, dict]:
    """200 with each rank's answer when every ready rank ended as wanted; else the first refusal's status (a
    rank's 4xx, or 502) with every failing rank's reason."""
    ranks = [{"rank": a.rank, "status": a.status, "message": a.message} for a in answers]
    failed = [a for a in answers if not a.held(unload)]
    if not failed:
        return 200, {"lora_name": name, "remembered": remembered, "ranks": ranks}
    first = failed[0].status
    status = first if 400 <= first < 500 and first not in (401, 403) else 502
    why = "; ".join(f"rank {a.rank}: {a.status or 'no answer'} {a.message}" for a in failed)
    verb = "unload" if unload else "load"
    note = " (remembered: ranks that start again get it)" if remembered else ""
    return status, _error(status, f"could not {verb} adapter '{name}' on {len(failed)} of {len(answers)} "
                                  f"ready rank(s){note}: {why}") | {"ranks": ranks}


def _named(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    return isinstance(value, str) and bool(value)


def _message(text: str) -> str:
    """An OpenAI-style error's message, else the text's first line (shortened)."""
    try:
        message = str(orjson.loads(text)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = text.strip().split("\n", 1)[0]
    return message if len(message) <= 300 else message[:297] + "..."


def _error(status: int, message: str) -> dict[str, Any]:
    etype = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "APIError")
    return {"error": {"message": message, "type": etype, "param": None, "code": status}}


def _json(status: int, data: object) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")
