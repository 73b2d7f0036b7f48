"""The core process: an EngineCore behind a ZMQ ROUTER socket, driven by a busy loop.

Front ends connect DEALER sockets (one identity each) and send ``[kind, payload]``, the messages of
``lbd.wire.core_messages``. The loop drains incoming messages without blocking while there is work, steps
the core, and sends each front end one ``outputs`` message per step with its own requests' outputs. When idle
it blocks in ``poll`` (so an idle core costs nothing) and keeps every front end's gauges fresh with ``stats``
at most every 100 ms.
It never waits on a front end: sends never block (unlimited high-water mark, unknown peers dropped).

``run_core`` serves one ``CoreLoop``: ``PlainCore`` here, or a member of an MoE DP group
(``lbd.engine.dp.rank``), whichever the rank's launcher picked (``lbd.engine.rank_core``, which is also the
``python -m`` entry point); this module never imports the group. SIGTERM drains: requests already in the core
finish (up to ``--shutdown-timeout``), then the process exits 0. SIGINT exits at once. With TP x PP workers,
a worker that dies ends this process at once with code 1 (its front ends then fail their in-flight requests
and answer 503 on /health), and the workers stop with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import zmq

from lbd.engine.config.args import EngineArgs
from lbd.engine.config.placement import pin_to_rank_cpus
from lbd.engine.core.engine_core import EngineCore, RequestRejected
from lbd.engine.procutil import freeze_startup_heap, keep_freed_memory, set_pdeathsig
from lbd.wire import core_messages as CM

if TYPE_CHECKING:
    from lbd.engine.metrics import CoreMetrics

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.1  # freshest gauges a front end gets between outputs
STATS_HEARTBEAT_S = 1.0  # unchanged stats are still re-sent this often
IDLE_POLL_MS = 100


@dataclass(slots=True)
class _Peer:
    last_sent: float = 0.0
    last_stats: CM.SchedulerStats | None = None


@dataclass(slots=True)
class LoopState:
    """What the loop and the signal handlers share: the front ends, who owns each request, the drain."""

    peers: dict[bytes, _Peer] = field(default_factory=dict)
    owner: dict[str, bytes] = field(default_factory=dict)  # request id -> front-end identity
    draining_since: float | None = None
    stop_now: bool = False


class CoreServer:
    """Message handling and the loop; split from ``run_core`` so the pieces stay small."""

    def __init__(self, core: EngineCore, sock: zmq.Socket, shutdown_timeout: float,
                 state: LoopState | None = None) -> None:
        self.core = core
        self.sock = sock
        self.shutdown_timeout = shutdown_timeout
        self.state = state or LoopState()
        self._info = CM.encode(core.core_info())

    # ---- incoming -------------------------------------------------------------------------------------
    def drain(self) -> None:
        sock = self.sock
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self.handle(frames)

    def handle(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            logger.warning("dropping a malformed message of %d frames", len(frames))
            return
        ident, kind = frames[0], frames[1]
        payload = frames[2] if len(frames) > 2 else b""
        self.state.peers.setdefault(ident, _Peer())
        if kind == CM.HELLO:
            self.sock.send_multipart([ident, CM.READY, self._info])
            return
        if kind not in (CM.ADD, CM.ABORT, CM.RESET, CM.LORA):
            logger.warning("dropping a message of unknown kind %r", kind[:32])
            return
        try:
            msg = CM.decode(kind, payload)
        except ValueError as e:  # a bad payload must not take the core down
            logger.warning("dropping a bad %r message: %s", kind, e)
            return
        if kind == CM.ADD:
            self._add(ident, msg)
        elif kind == CM.ABORT:
            for rid in self.core.abort(msg.ids, msg.reason):
                self.state.owner.pop(rid, None)
        elif kind == CM.LORA:
            answer = self.core.lora_command(msg, ident)
            if answer is not None:
                self.sock.send_multipart([ident, CM.LORA_DONE, CM.encode(answer)])
        else:
            ok = self.core.reset_prefix_cache()
            self.sock.send_multipart([ident, CM.RESET_DONE, CM.encode(CM.ResetDone(msg.id, ok))])

    def _add(self, ident: bytes, req: CM.EngineCoreRequest) -> None:
        try:
            self.core.add_request(req, ident)
        except RequestRejected as e:
            self.send_error(ident, req.request_id, e.message, e.status)
            return
        self.state.owner[req.request_id] = ident

    def send_error(self, ident: bytes, request_id: str, message: str, status: int) -> None:
        """An ``error`` for one request to the front end that sent it."""
        msg = CM.encode(CM.RequestError(request_id, message, status))
        self.sock.send_multipart([ident, CM.ERROR, msg])

    # ---- outgoing -------------------------------------------------------------------------------------
    def send_rejected(self) -> None:
        """Errors for the requests the core refused after admitting them (a grammar that did not compile)."""
        for rid, message, status in self.core.take_rejected():
            ident = self.state.owner.pop(rid, None)
            if ident is not None:
                self.send_error(ident, rid, message, status)

    def send_lora_answers(self) -> None:
        """Answers to adapter loads that finished (they ran in the LoRA loader thread)."""
        for ident, answer in self.core.take_lora_answers():
            self.sock.send_multipart([ident, CM.LORA_DONE, CM.encode(answer)])

    def send_outputs(self, outputs: list[CM.EngineCoreOutput], now: float) -> None:
        owner = self.state.owner
        by_peer: dict[bytes, list[CM.EngineCoreOutput]] = {}
        for o in outputs:
            ident = owner.get(o.request_id)
            if ident is None:
                continue
            if o.finish_reason is not None:
                del owner[o.request_id]
            by_peer.setdefault(ident, []).append(o)
        if not by_peer:
            return
        stats = self.core.stats()
        wall = time.time()
        for ident, outs in by_peer.items():
            msg = CM.encode(CM.EngineCoreOutputs(outs, stats, wall))
            self.sock.send_multipart([ident, CM.OUTPUTS, msg])
            peer = self.state.peers.setdefault(ident, _Peer())
            peer.last_sent, peer.last_stats = now, stats

    def send_stats(self, now: float) -> None:
        """Stats to each front end that heard nothing for 100 ms, if they changed (or 1 s went by). While the
        core has work every front end hears from it at least every 100 ms: its /health reads a long silence
        with requests in flight as a wedged core (--health-stall-timeout-s)."""
        stats = None
        busy = self.core.has_work()
        for ident, peer in self.state.peers.items():
            if now - peer.last_sent < STATS_INTERVAL_S:
                continue
            stats = stats or self.core.stats()
            if not busy and stats == peer.last_stats and now - peer.last_sent < STATS_HEARTBEAT_S:
                continue
            self.sock.send_multipart([ident, CM.STATS, CM.encode(stats)])
            peer.last_sent, peer.last_stats = now, stats

    # ---- loop -----------------------------------------------------------------------------------------
    def run(self) -> None:
        core, state = self.core, self.state
        next_stats = 0.0
        while not state.stop_now:
            prof = core.profiler
            if core.has_work():
                prof.begin()
                self.drain()
                prof.lap("ipc_in")
            else:
                if state.draining_since is not None:
                    break  # SIGTERM and nothing left to finish
                prof.idle()
                if self.sock.poll(IDLE_POLL_MS):
                    prof.begin()
                    self.drain()
                    prof.lap("ipc_in")
            if state.draining_since is not None and \
                    time.monotonic() - state.draining_since > self.shutdown_timeout:
                logger.warning("shutdown timeout: exiting with %d requests unfinished",
                               len(core.scheduler.requests))
                break
            now = time.monotonic()
            if core.has_work():
                self.send_outputs(core.step(), now)
                self.send_rejected()
                self.send_lora_answers()
                prof.lap("ipc_out")
            prof.end()
            if now >= next_stats:
                core.flush_metrics()
                self.send_stats(now)
                next_stats = now + STATS_INTERVAL_S


def _install_signals(state: LoopState) -> None:
    def on_term(signum: int, frame: object) -> None:
        if state.draining_since is None:
            logger.info("SIGTERM: finishing the requests in the core, then exiting")
            state.draining_since = time.monotonic()
        else:
            state.stop_now = True

    def on_int(signum: int, frame: object) -> None:
        state.stop_now = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_int)


def configure_logging(args: EngineArgs) -> None:
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s [core rank={args.rank} pid=%(process)d] %(name)s: %(message)s",
    )


class CoreLoop(Protocol):
    """What ``run_core`` serves: the core it builds and the loop around it."""

    def build(self, metrics: CoreMetrics) -> EngineCore:
        """Load the model and make the core; called before the ZMQ context exists (its I/O thread inherits
        this thread's CPU affinity)."""
        ...

    def server(self, core: EngineCore, ctx: zmq.Context, sock: zmq.Socket, state: LoopState) -> CoreServer:
        """The loop over the bound front-end socket (``ctx`` for any socket of its own)."""
        ...

    def close(self) -> None:
        """After the loop ended, before the core closes."""
        ...


class PlainCore:
    """The loop of a rank that is only itself: ``CoreServer`` over the core ``make_core`` builds."""

    def __init__(self, args: EngineArgs, make_core: Callable[[CoreMetrics], EngineCore]) -> None:
        self.args, self.make_core = args, make_core

    def build(self, metrics: CoreMetrics) -> EngineCore:
        core = self.make_core(metrics)
        if core.runner.device == "cpu":
            from lbd.engine.core.runner import pin_core_thread

            pin_core_thread()  # before the ZMQ context: its I/O thread inherits this CPU
        return core

    def server(self, core: EngineCore, ctx: zmq.Context, sock: zmq.Socket, state: LoopState) -> CoreServer:
        return CoreServer(core, sock, self.args.shutdown_timeout, state)

    def close(self) -> None:
        pass


def run_core(args: EngineArgs, input_address: str, loop: CoreLoop) -> None:
    """Build the core, bind ``input_address`` (a ROUTER), and serve front ends until told to stop."""
    set_pdeathsig(signal.SIGKILL)
    keep_freed_memory()
    configure_logging(args)
    cpus = pin_to_rank_cpus()
    if cpus is not None:
        logger.info("pinned to CPUs %s (LBD_RANK_CPUS)", os.environ["LBD_RANK_CPUS"])
    from lbd.engine.metrics import CoreMetrics

    core = loop.build(CoreMetrics(args.model_name, args.rank))
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a slow front end
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(input_address)
    state = LoopState()
    _install_signals(state)  # only now: a signal during the model load just ends the process
    freeze_startup_heap()
    logger.info("core ready on %s (pid %d)", input_address, os.getpid())
    server = loop.server(core, ctx, sock, state)
    try:
        server.run()
    except Exception:
        logger.exception("core loop failed")
        raise
    finally:
        loop.close()
        core.close()
        sock.close(linger=0)
        ctx.term()
        _remove_ipc_file(input_address)
        logger.info("core exited")


def exit_on_worker_failure(reason: str) -> None:
    """The executor's watchdog (another thread) saw a worker die: the rank cannot serve, so end the core now
    (its other workers are killed already)."""
    logger.error("%s: exiting; the front ends answer 503 and fail their in-flight requests", reason)
    logging.shutdown()
    os._exit(1)


def _remove_ipc_file(address: str) -> None:
    """libzmq leaves the socket file of a closed ipc:// endpoint behind; a restarted core would reuse it."""
    path = address.removeprefix("ipc://")
    if path != address and not path.startswith("@"):  # "@": Linux abstract namespace, no file
        with contextlib.suppress(OSError):
            os.unlink(path)
