"""The DP coordinator of an MoE group: ``python -m lbd.engine.dp.coordinator`` beside rank 0.

It hosts the group's TCPStore (``A:P+1``, so the store outlives any rank), a ZMQ ROUTER (``A:P+2``) the
ranks' cores talk to (``lbd.wire.dp_messages``), and HTTP (``A:P+3`` unless ``--http-port``): ``/status``
(JSON), ``/metrics`` (Prometheus), ``POST /members/{rank}/failed`` (the supervisor says a member died or
hangs) and ``POST /resize`` (``{"size": N}``: the group re-forms at N ranks), served by
``lbd.engine.dp.coordinator_http``. All of it is one asyncio loop that sleeps in epoll between messages: an
idle group costs nothing.

Generations: generation g forms when all N ranks have sent ``join`` (the coordinator then sends ``form g``)
and is ready once each answered ``joined g``. A failed member (the supervisor's POST, a rank's ``lost``,
or a ``join`` from a member of g, i.e. a restarted or fallen-out rank) aborts g: every rank is told, and
g+1 forms when all N have joined again. A restarted coordinator tells ranks that report a group it does not
know to leave it, and numbers its first generation after theirs.

Resizing (elastic expert parallelism): ``resize(N)`` of a ready generation g sends ``reform g N`` to every
member and waits for N joins of g+1. The members of g leave it together at their next idle check of a wave
(a member that is paused starts one), so no collective is cut: those ranked ``>= N`` drain out (their requests
fail with a retryable 503), the others re-place their experts for N members and join g+1 keeping their
requests; new members (started with size N) join g+1 as they come up. Reports of g are not answered with an
abort while it retires.

``Coordinator`` is the state machine (no I/O; it returns the messages to send), ``serve`` wires it to the
sockets.

Every socket binds ``--data-parallel-address`` (resolved), never every interface: a group on one machine
meets on loopback. With ``LBD_CLUSTER_TOKEN`` in the environment (the supervisor hands it over; never a flag)
the ZMQ channel is CURVE with key pairs derived from the token (only token holders complete the handshake; the
ranks derive the client side, ``lbd.common.cluster``) and every HTTP call needs ``Authorization: Bearer
<token>``. An address beyond loopback without a token is refused (exit 2) unless ``--insecure-cluster``.
The store cannot check the token (torch's TCPStore has no authentication): see ``lbd.engine.dp.group``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lbd.common.cluster import CLUSTER_TOKEN_ENV, NO_TOKEN_FIX, is_loopback, secure_zmq_server
from lbd.engine.dp import HTTP_PORT_OFFSET, STORE_PORT_OFFSET, ZMQ_PORT_OFFSET
from lbd.engine.dp.coordinator_http import Outgoing
from lbd.engine.dp.messages import log_unknown_kind
from lbd.wire import dp_messages as DM
from lbd.wire.dp import CoordinatorMember, CoordinatorStatus, DPState, Wave

if TYPE_CHECKING:
    pass

logger = logging.getLogger("lbd.engine.dp.coordinator")


@dataclass(slots=True)
class MemberInfo:
    rank: int
    ident: bytes | None = None
    pid: int | None = None
    pending: bool = False  # joined the generation being formed
    joined: bool = False  # in the current generation's process group
    waiting: int = 0
    running: int = 0
    last_report: float | None = None
    wave_active: bool = False


@dataclass(slots=True)
class Coordinator:
    size: int
    generation: int = 1
    state: DPState = DPState.FORMING
    form_sent: bool = False
    wave_active: bool = False
    wave_id: int = 0
    waves_ended: int = -1  # the last wave id of this generation that ended
    waves_total: int = 0
    aborts: int = 0
    resizes: int = 0
    retiring: int | None = None  # the generation a resize ends: its members still run its last steps
    wave_asked: int | None = None  # a wave a member started before every member had joined (it waits)
    members: list[MemberInfo] = field(default_factory=list)
    _strangers: set[int] = field(default_factory=set)  # ranks outside the group already warned about

    def __post_init__(self) -> None:
        self.members = [MemberInfo(r) for r in range(self.size)]

    # ---- messages from ranks ------------------------------------------------------------------------------
    def on_message(self, ident: bytes, msg: DM.RankMessage, now: float) -> Outgoing:
        rank = msg.rank
        if not 0 <= rank < self.size:
            if rank not in self._strangers:  # a member removed by a resize, or one started early for one
                self._strangers.add(rank)
                logger.warning("dropping messages from rank %r: the group has %d ranks", rank, self.size)
            return []
        m = self.members[rank]
        if isinstance(msg, DM.Report):
            m.ident = m.ident or ident
            m.waiting, m.running = msg.waiting, msg.running
            m.last_report, m.wave_active = now, msg.wave_active
            if msg.ready and not (m.joined and msg.generation == self.generation) \
                    and msg.generation != self.retiring:
                # a group this coordinator did not form (it was restarted) or already aborted: leave it
                why = "the coordinator does not know that generation (it restarted): re-join"
                return [(ident, DM.encode(DM.Abort(generation=msg.generation, reason=why)))]
            return []
        if isinstance(msg, DM.Join):
            if not self.form_sent and msg.last_generation >= self.generation:
                self.generation = msg.last_generation + 1  # a restarted coordinator numbers on after theirs
            return self._join(m, ident, msg.pid)
        if isinstance(msg, DM.Joined) and msg.generation == self.generation and self.form_sent and m.pending:
            m.joined = True
            if all(x.joined for x in self.members):
                self.state = DPState.READY
                logger.info("generation %d ready: %d members", self.generation, self.size)
                asked, self.wave_asked = self.wave_asked, None  # a member with work already stepped
                return self._wave_start(asked) if asked is not None else []
            return []
        if isinstance(msg, DM.Lost) and msg.generation == self.generation:
            return self.abort(f"rank {rank} lost generation {msg.generation}: {msg.reason}")
        if isinstance(msg, DM.WaveStarted) and msg.generation == self.generation:
            if self.state is DPState.READY:
                return self._wave_start(msg.wave)
            if self.form_sent:  # it formed and has work before the others said joined: start it then
                self.wave_asked = msg.wave
            return []
        if isinstance(msg, DM.WaveEnded) and msg.generation == self.generation and msg.wave == self.wave_id:
            if self.wave_active:
                self.wave_active, self.waves_ended = False, self.wave_id
        return []

    def _join(self, m: MemberInfo, ident: bytes, pid: int) -> Outgoing:
        out: Outgoing = []
        restarted = m.pid is not None and pid != m.pid
        if m.joined or (self.form_sent and m.pending and restarted):
            why = "restarted" if restarted else "fell out of the group"
            out = self.abort(f"rank {m.rank} {why} (pid {pid})")
        m.ident, m.pid, m.pending = ident, pid, True
        return out + self._maybe_form()

    def _maybe_form(self) -> Outgoing:
        if self.form_sent or not all(x.pending for x in self.members):
            return []
        self.form_sent = True
        logger.info("forming generation %d", self.generation)
        msg = DM.encode(DM.Form(generation=self.generation, size=self.size))
        return [(x.ident, msg) for x in self.members if x.ident is not None]

    def _wave_start(self, wave: int) -> Outgoing:
        if wave <= self.waves_ended or (self.wave_active and wave == self.wave_id):
            return []  # stale, or already running
        self.wave_active, self.wave_id = True, wave
        self.waves_total += 1
        msg = DM.encode(DM.StartWave(generation=self.generation, wave=wave))
        return [(x.ident, msg) for x in self.members if x.ident is not None and x.joined]

    # ---- failures -----------------------------------------------------------------------------------------
    def abort(self, reason: str) -> Outgoing:
        """End the current generation (when it formed or is forming) and wait for every rank again."""
        if not self.form_sent:
            return []  # nothing formed yet: the ranks still collecting joins go on waiting
        old = self.generation
        logger.warning("aborting generation %d: %s", old, reason)
        msg = DM.encode(DM.Abort(generation=old, reason=reason))
        out = [(x.ident, msg) for x in self.members if x.ident is not None]
        self.generation += 1
        self.state, self.form_sent, self.aborts = DPState.REFORMING, False, self.aborts + 1
        self.wave_asked = None
        self.wave_active, self.wave_id, self.waves_ended = False, 0, -1
        for x in self.members:
            x.pending = x.joined = x.wave_active = False
        return out

    def member_failed(self, rank: int, reason: str) -> Outgoing:
        """The supervisor says ``rank`` died or hangs (idempotent until the next generation forms)."""
        m = self.members[rank]
        out = self.abort(f"rank {rank} failed: {reason}") if m.joined or self.form_sent else []
        m.pending, m.ident, m.pid, m.last_report = False, None, None, None
        return out

    def resize(self, size: int) -> Outgoing:
        """Re-form the ready group at ``size`` ranks (ValueError when it is not ready or ``size`` < 1)."""
        if size < 1:
            raise ValueError(f"a group needs at least one rank, not {size}")
        if self.state is not DPState.READY:
            raise ValueError(f"generation {self.generation} is {self.state.value}: resize a ready group")
        old = self.generation
        logger.info("re-forming generation %d of %d ranks at %d ranks", old, self.size, size)
        msg = DM.encode(DM.Reform(generation=old, size=size))
        out = [(x.ident, msg) for x in self.members if x.ident is not None]
        kept = self.members[:size]
        self.members = kept + [MemberInfo(r) for r in range(len(kept), size)]
        self.size, self.retiring, self.resizes = size, old, self.resizes + 1
        self._strangers.clear()
        self.generation += 1
        self.state, self.form_sent, self.wave_asked = DPState.REFORMING, False, None
        self.wave_active, self.wave_id, self.waves_ended = False, 0, -1
        for x in self.members:
            x.pending = x.joined = x.wave_active = False
        return out

    # ---- views --------------------------------------------------------------------------------------------
    @property
    def reason(self) -> str | None:
        if self.state is DPState.READY:
            return None
        missing = [m.rank for m in self.members if not (m.joined if self.form_sent else m.pending)]
        what = "form" if self.form_sent else "join"
        return f"waiting for ranks {missing} to {what} generation {self.generation}"

    def status(self, now: float) -> CoordinatorStatus:
        return CoordinatorStatus(
            size=self.size, generation=self.generation, state=self.state, reason=self.reason,
            wave=Wave(active=self.wave_active, id=self.wave_id, count=self.waves_total),
            generation_aborts=self.aborts,
            members=[CoordinatorMember(rank=m.rank, pid=m.pid, joined=m.joined, waiting=m.waiting,
                                       running=m.running, wave_active=m.wave_active,
                                       last_report_age_s=(None if m.last_report is None
                                                          else round(now - m.last_report, 3)))
                     for m in self.members])


# ---- the process ------------------------------------------------------------------------------------------

ZMQ_PURPOSE = "lbd-dp-coordinator"  # the CURVE keys' derivation label (the ranks use the same)


async def serve(size: int, address: str, rpc_port: int, http_host: str, http_port: int,
                timeout_s: float, token: str | None = None) -> int:
    import zmq
    import zmq.asyncio
    from aiohttp import web

    from lbd.engine.dp.coordinator_http import CoordinatorMetrics, http_app  # aiohttp: only the process
    from lbd.engine.dp.group import host_store

    ip = socket.gethostbyname(address)
    store = host_store(ip, rpc_port + STORE_PORT_OFFSET, timeout_s)  # kept alive for the process's life
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a message to a rank that went away is dropped
    sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # a member's message is a few hundred bytes
    secure_zmq_server(sock, token, ZMQ_PURPOSE)
    sock.bind(f"tcp://{ip}:{rpc_port + ZMQ_PORT_OFFSET}")
    coord = Coordinator(size)
    metrics = CoordinatorMetrics()

    async def send(out: Outgoing) -> None:
        for ident, msg in out:
            await sock.send_multipart([ident, msg])

    app = http_app(coord, metrics, send, token)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, http_host, http_port).start()
    logger.info("coordinator of %d ranks: store %s:%d, ZMQ tcp://%s:%d%s, HTTP http://%s:%d (pid %d)", size,
                ip, rpc_port + STORE_PORT_OFFSET, ip, rpc_port + ZMQ_PORT_OFFSET,
                " (CURVE, cluster token)" if token else "", http_host, http_port, os.getpid())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def receive() -> None:
        while True:
            ident, data = await sock.recv_multipart()
            try:
                msg = DM.decode_from_rank(data)
            except DM.UnknownKind as e:
                log_unknown_kind(logger, e)
                continue
            except ValueError as e:
                logger.warning("dropping a bad message: %s", e)
                continue
            await send(coord.on_message(ident, msg, time.monotonic()))

    task = asyncio.create_task(receive())
    await stop.wait()
    task.cancel()
    await runner.cleanup()
    sock.close(linger=0)
    ctx.term()
    del store
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lbd.engine.dp.coordinator",
                                     description="The DP coordinator of an MoE group (beside rank 0).")
    parser.add_argument("--data-parallel-size", type=int, required=True, help="ranks in the group")
    parser.add_argument("--data-parallel-address", required=True, help="rank 0's node (this one)")
    parser.add_argument("--data-parallel-rpc-port", type=int, required=True,
                        help="base port P: store P+1, ZMQ P+2, HTTP P+3")
    parser.add_argument("--http-host", default=None, help="HTTP bind address (default: the address)")
    parser.add_argument("--http-port", type=int, default=None, help="HTTP port (default: P+3)")
    parser.add_argument("--distributed-timeout-s", type=float, default=600.0, help="the store's timeout")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--insecure-cluster", action="store_true",
                        help=f"serve an address beyond loopback without {CLUSTER_TOKEN_ENV} "
                             "(unauthenticated)")
    ns = parser.parse_args(argv)
    if ns.data_parallel_size < 1:
        parser.error(f"--data-parallel-size must be >= 1, got {ns.data_parallel_size}")
    if not 1 <= ns.data_parallel_rpc_port <= 65532:
        parser.error(f"--data-parallel-rpc-port {ns.data_parallel_rpc_port} is out of range: use 1..65532")
    try:
        socket.gethostbyname(ns.data_parallel_address)
    except OSError as e:
        parser.error(f"--data-parallel-address {ns.data_parallel_address} does not resolve: {e}")
    token = os.environ.get(CLUSTER_TOKEN_ENV) or None
    http_host = ns.http_host or ns.data_parallel_address
    wide = [h for h in {ns.data_parallel_address, http_host} if not is_loopback(h)]
    if wide and token is None and not ns.insecure_cluster:
        parser.error(f"{wide[0]} is beyond loopback and the group's wires would be open to anyone: "
                     f"{NO_TOKEN_FIX}")
    from lbd.engine.procutil import set_pdeathsig

    set_pdeathsig(signal.SIGKILL)
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)  # our own registry, not an engine's multiprocess files
    logging.basicConfig(level=getattr(logging, ns.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s dp-coordinator[%(process)d] %(levelname)s %(message)s")
    port = ns.http_port if ns.http_port is not None else ns.data_parallel_rpc_port + HTTP_PORT_OFFSET
    import uvloop
    import zmq

    try:

        return uvloop.run(serve(ns.data_parallel_size, ns.data_parallel_address, ns.data_parallel_rpc_port,
                                http_host, port, ns.distributed_timeout_s, token))
    except (OSError, zmq.ZMQError) as e:  # a port is taken (the ZMQ one or HTTP)
        print(f"dp coordinator: error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # the TCPStore could not bind
        print(f"dp coordinator: error: store port {ns.data_parallel_rpc_port + STORE_PORT_OFFSET}: {e}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
