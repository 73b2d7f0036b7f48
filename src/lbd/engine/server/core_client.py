"""Async ZMQ client of the engine core: one DEALER socket per front end, one queue per HTTP request.

A reader task routes each ``outputs`` entry to the queue registered for its request id; a watcher task
notices the core process dying and fails every registered queue, so no handler waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable

import psutil
import zmq
import zmq.asyncio

from lbd.engine.core.step_profile import FrontendProfiler
from lbd.wire import core_messages as CM
from lbd.wire.dp import DPStatus

logger = logging.getLogger(__name__)
_WATCH_INTERVAL_S = 0.2
# A hello sent before the core binds is queued by ZMQ and delivered at bind; resending is only a safety net.
_HELLO_RESEND_S = 2.0
_HELLO = CM.encode(CM.Hello())


class CoreError(Exception):
    """The core refused or lost a request (``status`` is the HTTP status to answer with)."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class CoreClient:
    def __init__(self, address: str, core_pid: int | None, profile_steps: int = 0) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, f"fe-{os.getpid()}-{secrets.token_hex(4)}".encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        # Never drop outputs: a slow front end should slow down, not lose tokens.
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.connect(address)
        self._core_pid = core_pid
        self._routes: dict[str, asyncio.Queue] = {}
        self._info: asyncio.Future[CM.CoreInfo] | None = None
        self._resets: dict[str, asyncio.Future[bool]] = {}
        self._lora: dict[str, asyncio.Future[CM.LoraDone]] = {}
        self._tasks: list[asyncio.Task] = []
        self.stats = CM.SchedulerStats()
        self.dead_reason: str | None = None
        # --profile-steps: this front end's ipc / detokenize / stream costs (engine/core/step_profile.py)
        self.profiler = FrontendProfiler(profile_steps, f"frontend pid={os.getpid()}") \
            if profile_steps else None
        # Loop time of the core's last message: while it has work it sends something at least every 100 ms
        # (outputs or stats), so a long silence with requests in flight means a wedged core (see /health).
        self.last_heard = 0.0
        # Loop time of the first message sent since the core last spoke (None: it answered since). A live
        # core answers anything within a second (an idle one still sends stats every second), so this
        # growing old is a stall too, also once the requests that were waiting have been given up.
        self.pending_since: float | None = None
        self.dp: DPStatus | None = None  # the core's DP-group status; None: no group
        self.on_stats: Callable[[CM.SchedulerStats], None] | None = None  # the load stream's feed

    @property
    def core_pid(self) -> int | None:
        return self._core_pid

    @property
    def alive(self) -> bool:
        return self.dead_reason is None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._info = loop.create_future()
        self.last_heard = loop.time()
        self._tasks = [asyncio.create_task(self._read(), name="core-reader"),
                       asyncio.create_task(self._watch(), name="core-watcher")]

    async def hello(self, timeout: float) -> CM.CoreInfo:
        """Ask until the core answers with its CoreInfo (it may still be loading the model)."""
        assert self._info is not None, "start() first"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self._info.done():
            if not self.alive:
                raise CoreError(self.dead_reason or "engine core died", 503)
            if loop.time() > deadline:
                raise TimeoutError(f"engine core did not answer within {timeout:.0f}s")
            await self._sock.send_multipart([CM.HELLO, _HELLO])
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._info), _HELLO_RESEND_S)
        return self._info.result()

    def register(self, request_id: str, queue: asyncio.Queue) -> None:
        self._routes[request_id] = queue

    def unregister(self, request_id: str) -> None:
        self._routes.pop(request_id, None)

    async def add(self, req: CM.EngineCoreRequest) -> None:
        if not self.alive:
            raise CoreError(self.dead_reason or "engine core died", 503)
        self._sent()
        await self._sock.send_multipart([CM.ADD, CM.encode(req)])

    async def abort(self, request_ids: list[str], reason: str = "abort") -> None:
        """Stop requests in the core; reason "stop" counts them as finished by a stop string."""
        if request_ids and self.alive:
            self._sent()
            await self._sock.send_multipart([CM.ABORT, CM.encode(CM.Abort(request_ids, reason))])

    async def reset_prefix_cache(self, timeout: float = 10.0) -> bool:
        """Ask the core to forget its prefix cache; False when requests hold blocks."""
        if not self.alive:
            raise CoreError(self.dead_reason or "engine core died", 503)
        rid = secrets.token_hex(8)
        done = self._resets[rid] = asyncio.get_running_loop().create_future()
        try:
            self._sent()
            await self._sock.send_multipart([CM.RESET, CM.encode(CM.ResetPrefixCache(rid))])
            return await asyncio.wait_for(done, timeout)
        finally:
            self._resets.pop(rid, None)

    async def lora_command(self, op: str, name: str, path: str = "", base_model_name: str | None = None,
                           timeout: float = 600.0) -> CM.LoraDone:
        """Load or unload an adapter in the core; its answer (HTTP status and message)."""
        if not self.alive:
            raise CoreError(self.dead_reason or "engine core died", 503)
        cid = secrets.token_hex(8)
        done = self._lora[cid] = asyncio.get_running_loop().create_future()
        try:
            self._sent()
            await self._sock.send_multipart([CM.LORA, CM.encode(CM.LoraCommand(cid, op, name, path,
                                                                                base_model_name))])
            return await asyncio.wait_for(done, timeout)
        finally:
            self._lora.pop(cid, None)

    def _sent(self) -> None:
        if self.pending_since is None:
            self.pending_since = asyncio.get_running_loop().time()

    def silence(self, now: float) -> float:
        """How long the core has been expected to speak and has not (0 when nothing is expected)."""
        if self._routes:
            return now - self.last_heard
        return now - self.pending_since if self.pending_since is not None else 0.0

    @property
    def in_flight(self) -> int:
        """Core requests this front end waits on."""
        return len(self._routes)

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            kind, payload = await self._sock.recv_multipart(copy=True)
            t0 = time.perf_counter()
            self.last_heard = loop.time()
            self.pending_since = None
            try:
                tokens = self._dispatch(CM.decode(kind, payload))
            except Exception:  # a malformed message must not kill the reader (and every request with it)
                logger.exception("bad %r message from the core", kind)
                continue
            if self.profiler is not None and kind == CM.OUTPUTS:
                self.profiler.add("ipc", time.perf_counter() - t0)
                self.profiler.message(tokens)

    def _dispatch(self, msg: object) -> int:
        """Route one decoded message; returns the number of tokens it carried."""
        if isinstance(msg, CM.EngineCoreOutputs):
            self.stats = msg.stats
            if self.on_stats is not None:
                self.on_stats(msg.stats)
            tokens = 0
            for out in msg.outputs:
                tokens += len(out.new_token_ids)
                queue = self._routes.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            return tokens
        if isinstance(msg, CM.SchedulerStats):
            self.stats = msg
            if self.on_stats is not None:
                self.on_stats(msg)
        elif isinstance(msg, DPStatus):
            self.dp = msg
        elif isinstance(msg, CM.RequestError):
            queue = self._routes.get(msg.request_id)
            if queue is not None:
                queue.put_nowait(CoreError(msg.message, msg.status))
            else:
                logger.warning("core error: %s", msg.message)
        elif isinstance(msg, CM.LoraDone):
            lora_done = self._lora.get(msg.id)
            if lora_done is not None and not lora_done.done():
                lora_done.set_result(msg)
        elif isinstance(msg, CM.ResetDone):
            done = self._resets.get(msg.id)
            if done is not None and not done.done():
                done.set_result(msg.ok)
        elif isinstance(msg, CM.CoreInfo) and self._info is not None and not self._info.done():
            self._info.set_result(msg)
        return 0

    async def _watch(self) -> None:
        if self._core_pid is None:
            return
        try:
            core = psutil.Process(self._core_pid)
        except psutil.NoSuchProcess:
            core = None
        while core is not None and _running(core):
            await asyncio.sleep(_WATCH_INTERVAL_S)
        self._die(f"engine core process {self._core_pid} died")

    def _die(self, reason: str) -> None:
        logger.error("%s: failing %d in-flight requests", reason, len(self._routes))
        self.dead_reason = reason
        err = CoreError(reason, 503)
        for queue in self._routes.values():
            queue.put_nowait(err)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._sock.close(linger=0)
        self._ctx.term()


def _running(proc: psutil.Process) -> bool:
    """True while ``proc`` lives; a zombie (dead, not yet reaped by its parent) counts as dead."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
