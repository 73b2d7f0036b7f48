"""The supervisor's health port (default 9256): what orchestrators, routers and operators read.

Every answer is built from the state the probe loops last recorded; no handler ever waits on a rank.

GET /health   liveness. 200 while the supervisor runs and has not given up; 503 once a rank failed under
              ``--on-rank-failure exit``. Body: one line of text (the reason).
GET /readyz   readiness. 200 when the ready ranks meet ``--ready-policy`` (all | any | k), 503 otherwise
              and at once after SIGTERM/SIGINT. Body: one line that says why, e.g.
              ``1/2 ranks ready (policy all needs 2): rank 1 restarting (attempt 4 in 3.2 s): exited with
              code 1: ValueError: model.safetensors: invalid header``. The ranks of an MoE model form one
              group (supervisor/group.py): 200 when it serves, e.g. ``MoE group (MixtralForCausalLM with 8
              experts, 2 ranks, expert parallel): generation 2 reforming: waiting for ranks [1] ...``.
GET /status   JSON, for routers (``lbd route --upstreams supervisor://host:9256``) and people; the type is
              ``lbd.wire.status.SupervisorStatus``::

    {
      "ready": true,                 # same answer as /readyz
      "live": true,                  # same answer as /health
      "reason": "2/2 ranks ready (policy all)",
      "phase": "running",            # running | stopping (after SIGTERM) | failed (--on-rank-failure exit)
      "pid": 4242,                   # the supervisor's pid
      "node_rank": 0, "data_parallel_size": 4, "data_parallel_size_local": 2, "data_parallel_start_rank": 0,
      "ready_policy": "all", "ready_ranks": 2, "on_rank_failure": "restart",
      "probe": {"interval_s": 5.0, "timeout_s": 5.0, "failure_threshold": 3, "generate_every": 0},
      "uptime_s": 73.2,
      "rolling_restart": null,       # or {"state": running|done|failed|cancelled, "started_at",
                                     #     "finished_at", "current_rank", "done_ranks": [0, ...], "error"}
      "scaling": null,               # the last resize (POST /scale): {"previous", "target", "added": [2],
                                     #     "removing": [], "state": running|done|failed, "error",
                                     #     "started_at", "finished_at"}
      "ranks": [
        {
          "rank": 0,                 # global DP rank (what X-data-parallel-rank names)
          "local_rank": 0,
          "url": "http://10.0.0.5:8000",  # the engine's base URL (https:// with --ssl-certfile); with a
                                          # wildcard --host, the host part is the one this request used
          "port": 8000,
          "pid": 4243,               # the rank's launcher pid (null while it is down)
          "state": "ready",          # starting | ready | unhealthy | restarting | draining | stopped | failed
          "routable": true,          # true only in state ready: routers send new requests only to these
          "state_since": 1767000000.1,    # unix time of the last state change
          "consecutive_failures": 0, "restarts": 0,
          "last_probe_latency_s": 0.0011, "last_probe_at": 1767000070.0,
          "last_probe_error": null,  # e.g. "no answer within 5 s", "/health answered 503"
          "uptime_s": 70.2,          # of the current process (null while down)
          "ready_for_s": 65.0,       # since it last became ready (null when not ready in this process)
          "last_failure": null, "last_failure_at": null,  # why and when it last failed
          "last_exit_code": null,    # negative: killed by that signal
          "next_start_in_s": null,   # in state restarting: the backoff left
          "operation": null,         # "drain" or "restart" while an admin command is carried out
          "devices": "0,1",          # its CUDA_VISIBLE_DEVICES, null off CUDA
          "cpus": null,              # its CPU slice (LBD_RANK_CPUS, e.g. "0-7"), null on CUDA
          "engine": "lbd",           # --rank-engine: lbd | vllm | sglang, or "command" (--rank-command)
          "workers": [               # its TP x PP worker processes ([] when TP x PP = 1), read from its
                                     # process tree when it became ready; [] while it is down
            {"pid": 4250, "rank": 0, "tp_rank": 0, "pp_rank": 0, "cpus": "0-3"}
          ],
          "kv_event_sources": {"0": {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", ...}},
                                     # the ready rank's /kv_event_sources (vLLM's shape; {} when events are
                                     # off, null until ready)
          "attempts": 0,             # consecutive failed starts (a crash loop); 0 once ready
          "backoff_s": null,         # the restart delay last applied (doubles per failure up to the cap)
          "stderr_tail": [],         # last stderr lines of the failed (or starting) process, secrets masked
          "command": ["python", "-m", "lbd.engine", "..."],  # its command line, secret values masked
          "group_wait": null,        # an MoE member alive but waiting for its group: why (not routable)
          "group": 0                 # only for MoE members: the index of its entry in "groups"
        }
      ],
      "groups": [                    # [] for dense models (independent ranks); one MoE group otherwise
        {
          "group": 0, "kind": "moe", "model": "MixtralForCausalLM", "num_experts": 8, "size": 2,
          "local_ranks": [0, 1], "expert_parallel": true, "on_rank_failure": "restart-group",
          "ready": true, "reason": "MoE group (...): generation 2 ready",
          "generation": 2, "state": "ready",          # the coordinator's: forming | ready | reforming
          "wave": {"active": false, "id": 3, "count": 9}, "generation_aborts": 1,
          "rendezvous": {"address": "127.0.0.1", "rpc_port": 29550, "store_port": 29551,
                         "coordinator_port": 29552, "coordinator_http_port": 29553},
          "coordinator": {"url": "http://127.0.0.1:29553", "local": true, "pid": 4240, "alive": true,
                          "restarts": 0, "last_exit_code": null, "status_age_s": 0.04, "error": null},
          "members": [               # every member of the group, this node's and the others'
            {"rank": 0, "local": true, "state": "ready", "pid": 4243, "group_wait": null,
             "core_pid": 4247, "joined": true, "waiting": 0, "running": 3,    # as the coordinator heard
             "last_report_age_s": 0.05, "wave_active": true}
          ],
          "recovering": [],          # failed members not yet back: {"rank", "why", "failed_at", "for_s"}
          "recoveries": 1,
          "last_recovery": {"rank": 1, "why": "killed by SIGKILL", "ready_after_s": 14.2, ...}
        }
      ]
    }

GET /metrics  Prometheus text: lbd_supervisor_rank_ready{rank}, lbd_supervisor_rank_state{rank,state},
              lbd_supervisor_rank_restarts_total{rank}, lbd_supervisor_probe_duration_seconds{rank},
              lbd_supervisor_probe_failures_total{rank,reason}, lbd_supervisor_ready,
              lbd_supervisor_ready_ranks, lbd_supervisor_ranks, lbd_supervisor_phase{phase}; with an MoE
              group lbd_supervisor_group_ready, _generation, _wave_active, _member_joined{rank},
              _requests_waiting{rank}, _requests_running{rank}, _member_failures_total{rank},
              lbd_supervisor_group_recovery_seconds, lbd_supervisor_coordinator_up,
              lbd_supervisor_coordinator_restarts; lbd_supervisor_resizes_total{direction,outcome} (POST
              /scale: grow | shrink | none, done | failed | refused).

Admin (only with ``--admin-token`` or ``$LBD_ADMIN_TOKEN``; 404 without one, 401 on a missing or wrong
``Authorization: Bearer <token>``); each answers 202 with JSON at once and works in the background:
POST /ranks/{rank}/drain     state draining (routers stop sending), wait for zero in-flight requests, restart.
POST /ranks/{rank}/restart   SIGTERM (the engine finishes its requests), then start again (ends a backoff).
POST /rolling-restart        drain and restart one rank at a time, each waiting for the previous to be ready.
POST /scale   {"data_parallel_size_local": N}: resize the node (supervisor/scale.py: who may, and how ranks
              come and go); 202 with the ``ScaleResult`` (lbd.wire.scale), 200 when N is the current size, 400
              naming the field, 409 with the reason when it cannot happen (the node unchanged). Besides the
              admin token it takes the cluster token; with neither set it is open on a loopback-only port.
POST /v1/load_lora_adapter, /v1/unload_lora_adapter   (also behind VLLM_ALLOW_RUNTIME_LORA_UPDATING) every
                             ready rank loads (unloads) the adapter; a rank that starts again gets the node's
                             adapters back before it is ready; answered when done (supervisor/adapters.py).
Errors are OpenAI-style: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status in ``code``.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from lbd.common.aio_guard import GuardedAppRunner
from lbd.common.auth import KeyRing
from lbd.common.cluster import is_loopback
from lbd.common.limits import Limits, PeerReadTooLarge, raise_open_files_limit, read_capped
from lbd.common.tls import server_context
from lbd.supervisor.autoscale_signals import NodeSignals
from lbd.supervisor.config import WILDCARD_HOSTS
from lbd.supervisor.node import PHASES, Supervisor  # one way: the node never imports this module
from lbd.supervisor.rank_types import Command
from lbd.supervisor.scale import Scaler, ScaleRefused, scale_denied, scale_keys
from lbd.wire import scale as wire_scale

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 409: "ConflictError"}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "APIError"), "param": param,
                      "code": status}}
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json",
                        headers=headers)


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


def _text(ok: bool, reason: str) -> web.Response:
    return web.Response(status=200 if ok else 503, text=reason + "\n")


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.status, f"{request.method} {request.path}: {e.reason}")


class AppServer:
    """An aiohttp app served on a socket bound beforehand (the port is ours from validation on); no access
    log, no signal handlers (the owner handles SIGTERM). Subclasses set ``self.app``, and may set ``limits``
    (lbd.common.limits, enforced by lbd.common.aio_guard) and ``tls`` (a server SSL context)."""

    app: web.Application
    limits: Limits = Limits()
    tls: ssl.SSLContext | None = None
    _runner: web.AppRunner | None = None

    async def start(self, sock: socket.socket) -> None:
        raise_open_files_limit(self.limits.max_connections)
        self._runner = GuardedAppRunner(self.app, self.limits, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.SockSite(self._runner, sock, ssl_context=self.tls).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


class HealthServer(AppServer):
    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        cfg = sup.cfg
        self.limits = cfg.limits
        self.tls = server_context(cfg.ssl_certfile, cfg.ssl_keyfile, cfg.ssl_ca_certs, cfg.ssl_cert_reqs)
        self._admin = KeyRing.from_secrets([cfg.admin_token]) if cfg.admin_token else KeyRing()
        self._scale_keys = scale_keys(cfg.admin_token, cfg.cluster_token)
        self.scaler = Scaler(sup)
        self.signals = NodeSignals(sup)  # lbd_supervisor_autoscale_* on /metrics
        self.app = web.Application(middlewares=[json_errors])
        self.app.add_routes([
            web.get("/health", self.health), web.get("/readyz", self.readyz),
            web.get("/status", self.status), web.get("/metrics", self.metrics),
            web.post("/ranks/{rank}/drain", self.drain), web.post("/ranks/{rank}/restart", self.restart),
            web.post("/rolling-restart", self.rolling_restart), web.post("/scale", self.scale),
        ])
        self.app.add_routes(sup.adapters.routes(self._denied))  # the node's LoRA adapters (.adapters)

    # ---- read-only ----------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return _text(*self.sup.liveness())

    async def readyz(self, request: web.Request) -> web.Response:
        return _text(*self.sup.readiness())

    async def status(self, request: web.Request) -> web.Response:
        from lbd.wire import status as wire_status  # lazily, for cold start (lbd.wire.states)

        return web.Response(body=wire_status.encode(self.sup.status(self._url_host(request))),
                            content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        m = self.sup.metrics
        m.node_ready.set(1 if self.sup.readiness()[0] else 0)
        m.ready_ranks.set(self.sup.ready_count())
        m.set_phase(self.sup.phase, PHASES)
        return web.Response(body=self.sup.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    def _url_host(self, request: web.Request) -> str:
        """Host part of rank URLs: the engine's --host, or (wildcard bind) the host the caller used."""
        bind = self.sup.cfg.ranks[0].bind_host if self.sup.cfg.ranks else None
        if bind not in WILDCARD_HOSTS:
            return f"[{bind}]" if ":" in bind else bind  # type: ignore[operator]
        host = request.host
        if host.startswith("["):
            return host[: host.index("]") + 1]
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        return name if name and name not in ("0.0.0.0",) else "127.0.0.1"

    # ---- admin --------------------------------------------------------------------------------------------
    def _denied(self, request: web.Request) -> web.Response | None:
        if not self._admin:
            return error_response(404, f"{request.path}: admin endpoints are off; start lbd supervise with "
                                       "--admin-token (or LBD_ADMIN_TOKEN) to enable them")
        # compared as bytes in constant time: a header that is not UTF-8 is a wrong token, not a 500
        if self._admin.check_header(request.headers.get("Authorization")) is None:
            return error_response(401, "missing or wrong bearer token: send Authorization: Bearer <token>")
        return None

    def _rank(self, request: web.Request) -> tuple[int | None, web.Response | None]:
        text = request.match_info["rank"]
        try:
            rank = int(text)
        except ValueError:
            return None, error_response(400, f"rank must be an integer, got {text!r}", param="rank")
        if self.sup.worker(rank) is None:
            ranks = [w.spec.rank for w in self.sup.workers]
            return None, error_response(404, f"rank {rank} is not on this node (its ranks: {ranks})",
                                        param="rank")
        return rank, None

    async def _command(self, request: web.Request, command: Command) -> web.Response:
        denied = self._denied(request)
        if denied is not None:
            return denied
        rank, bad = self._rank(request)
        if bad is not None or rank is None:
            return bad or error_response(400, "bad rank")
        worker = self.sup.worker(rank)
        assert worker is not None
        why = worker.request(command)
        if why:
            return error_response(409, why, param="rank")
        return _json({"rank": rank, "action": command.value, "accepted": True}, status=202)

    async def drain(self, request: web.Request) -> web.Response:
        return await self._command(request, Command.DRAIN)

    async def restart(self, request: web.Request) -> web.Response:
        return await self._command(request, Command.RESTART)

    async def rolling_restart(self, request: web.Request) -> web.Response:
        denied = self._denied(request)
        if denied is not None:
            return denied
        why = self.sup.start_rolling_restart()
        if why:
            return error_response(409, why)
        return _json({"action": "rolling-restart", "accepted": True,
                      "ranks": [w.spec.rank for w in self.sup.workers]}, status=202)

    async def scale(self, request: web.Request) -> web.Response:
        denied = scale_denied(request.headers.get("Authorization"), self._scale_keys,
                              is_loopback(self.sup.cfg.supervisor_host))
        if denied is not None:
            return error_response(*denied)
        try:
            body = await read_capped(request.content.readany, wire_scale.MAX_BODY_BYTES,
                                     request.content_length, "POST /scale's body")
            target = wire_scale.decode_request(body).data_parallel_size_local
        except (wire_scale.ScaleRequestError, PeerReadTooLarge) as e:
            return error_response(400, str(e), getattr(e, "param", None))
        try:
            status, result = self.scaler.request(target)
        except ScaleRefused as e:
            return error_response(409, str(e), "data_parallel_size_local")
        return web.Response(status=status, body=wire_scale.encode(result), content_type="application/json")
