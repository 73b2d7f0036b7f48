"""The core loop of one rank of an MoE DP group: waves, dummy passes, and healing without a restart.

``GroupMember`` is the core process's ``CoreLoop`` for such a rank (``lbd.engine.rank_core`` picks it): it
makes the rank's EngineCore (its model holds this member's experts, routed through an
``ExpertDispatcher``), a ``Member`` (its link to the coordinator) and ``MemberServer``, the loop
(``lbd.engine.core.process.CoreServer`` plus the group):

* not ready (forming / re-forming): it answers front ends (new requests get 503), sends ``join`` to the
  coordinator every second and, on ``form g``, creates generation g's process group;
* ready and paused: it blocks in ``poll`` on the front ends' and the coordinator's sockets (no CPU); a request
  starts a wave (told to the coordinator, which tells every rank);
* in a wave: one pass per loop (a real step, or a zero-token dummy pass through the MoE layers when nothing is
  scheduled), and every ``--dp-idle-check-steps`` passes an all-reduce of "still has work" ends the wave when
  every rank is idle;
* a failed collective (``GroupLost``) or an ``abort`` from the coordinator: every in-flight request fails
  with 503 (before its first byte: a router retries it; a started stream ends with an error event), the
  process group is dropped, and the rank joins the next generation with the same process and weights;
* a ``reform`` to N members (an elastic resize): the rank starts a wave if it is paused, and every idle check
  of a wave exchanges (has work, N asked) instead of the idle flag alone, so all members see the resize at
  the same step and leave the generation together (no collective is cut). A rank ``>= N`` then drains out:
  its requests fail with a retryable 503 (a router resumes them elsewhere) and it never joins again. The
  others re-place their experts for N (``lbd.engine.dp.elastic``: kept ones stay, new ones are read from the
  checkpoint) and join the next generation; their requests stay scheduled with their KV blocks and go on
  when it forms.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import torch
import zmq

from lbd.common.cluster import CLUSTER_TOKEN_ENV, secure_zmq_client
from lbd.engine.config.args import EngineArgs
from lbd.engine.core.engine_core import EngineCore
from lbd.engine.core.process import IDLE_POLL_MS, CoreServer, LoopState
from lbd.engine.core.runner import ModelRunner
from lbd.engine.dp import endpoints
from lbd.engine.dp.coordinator import ZMQ_PURPOSE
from lbd.engine.dp.elastic import replace_experts
from lbd.engine.dp.expert_parallel import ExpertDispatcher, ExpertPlan, attach, dummy_pass, routed_experts
from lbd.engine.dp.group import DPGroup, GroupLost, store_client
from lbd.engine.dp.messages import JOIN_RESEND_S, REPORT_INTERVAL_S, log_unknown_kind
from lbd.engine.dp.wave import Wave
from lbd.engine.models.config import load_hf_config
from lbd.wire import core_messages as CM
from lbd.wire.dp import DPState, DPStatus
from lbd.wire.dp_messages import (
    Abort,
    CoordinatorMessage,
    Form,
    Join,
    Joined,
    Lost,
    RankMessage,
    Reform,
    Report,
    StartWave,
    UnknownKind,
    WaveEnded,
    WaveStarted,
    decode_from_coordinator,
    encode,
)

logger = logging.getLogger(__name__)


class DPMetrics:
    def __init__(self, model_name: str, rank: int) -> None:
        from prometheus_client import Counter, Gauge

        lv = {"model_name": model_name, "engine": str(rank)}
        labels = tuple(lv)
        self.steps = Counter("lbd_dp_steps", "Forward passes of this rank in DP waves.", labels).labels(**lv)
        self.dummy_steps = Counter("lbd_dp_dummy_steps", "Of those, dummy passes (nothing scheduled here).",
                                   labels).labels(**lv)
        self.waves = Counter("lbd_dp_waves", "DP waves this rank took part in.", labels).labels(**lv)
        self.generation = Gauge("lbd_dp_group_generation", "The DP group generation this rank is in.", labels,
                                multiprocess_mode="mostrecent").labels(**lv)
        self.ready = Gauge("lbd_dp_group_ready", "1 while this rank's DP group is formed.", labels,
                           multiprocess_mode="mostrecent").labels(**lv)


class Member:
    """This rank's place in the group: the coordinator link, the current generation's group, the wave."""

    def __init__(self, args: EngineArgs, runner: ModelRunner, dispatcher: ExpertDispatcher,
                 blocks: list, ctx: zmq.Context, model_path: str) -> None:
        self.args, self.runner, self.dispatcher, self.blocks = args, runner, dispatcher, blocks
        self.model_path = model_path  # where a resize reads the experts newly assigned here
        self.rank, self.size = args.rank, args.data_parallel_size
        self.reform_to = 0  # the group size a ``reform`` asked for (0: none pending)
        self.removed: str | None = None  # why this rank left the group for good (a resize below it)
        self.store_host, self.store_port, coordinator = endpoints(args)
        self.wave = Wave(args.dp_idle_check_steps)
        self.group: DPGroup | None = None
        self.status = DPStatus(expert_parallel=args.enable_expert_parallel,
                               all2all_backend=dispatcher.plan.backend)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"rank{self.rank}-{os.getpid()}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # the coordinator's messages are a few dozen bytes
        secure_zmq_client(self.sock, os.environ.get(CLUSTER_TOKEN_ENV) or None, ZMQ_PURPOSE)
        self.sock.connect(coordinator)
        self.last_join = 0.0
        self.metrics = DPMetrics(args.model_name, self.rank)
        self.metrics.ready.set(0)

    @property
    def ready(self) -> bool:
        return self.group is not None

    def send(self, msg: RankMessage) -> None:
        try:
            self.sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # the coordinator is away; joins and reports are re-sent
            pass

    def join_if_due(self, now: float) -> None:
        if self.group is None and self.removed is None and now - self.last_join >= JOIN_RESEND_S:
            self.send(Join(self.rank, pid=os.getpid(), last_generation=self.status.generation))
            self.last_join = now

    def form(self, generation: int) -> str | None:
        """Create generation ``generation``'s process group; the failure reason, or None."""
        timeout = self.args.distributed_timeout_s
        try:
            store = store_client(self.store_host, self.store_port, timeout)
            self.group = DPGroup(store, self.rank, self.size, generation, self.runner.torch_device, timeout)
        except (GroupLost, RuntimeError) as e:
            return str(e)
        self.dispatcher.group = self.group
        self.wave.reset()
        self.status.state, self.status.generation, self.status.reason = DPState.READY, generation, None
        self.metrics.generation.set(generation)
        self.metrics.ready.set(1)
        self.send(Joined(self.rank, generation=generation))
        logger.info("DP group generation %d formed: rank %d of %d (%s experts, %s)", generation, self.rank,
                    self.size, "expert-parallel" if self.args.enable_expert_parallel else "tensor-parallel",
                    self.dispatcher.plan.backend)
        return None

    def leave(self, reason: str) -> None:
        if self.group is not None:
            self.group.close()
        self.group = self.dispatcher.group = None
        self.wave.reset()
        self.status.state, self.status.reason = DPState.REFORMING, reason
        self.metrics.ready.set(0)
        self.last_join = 0.0  # join the next generation at once

    def dummy_pass(self) -> None:
        r = self.runner
        dummy_pass(self.blocks, r.model.cfg.hidden_size, r.torch_device, r.torch_dtype)

    def idle_check(self, has_work: bool) -> tuple[bool, int]:
        """(does any member have work, the group size a pending ``reform`` asks for or 0): the same answer
        on every member, after the same step."""
        assert self.group is not None
        mine = torch.tensor([int(has_work), self.reform_to], dtype=torch.int64)
        if self.group.device.type == "cuda":
            mine = mine.to(self.group.device)
        every = torch.stack(self.group.all_gather(mine)).cpu()
        return bool(every[:, 0].any()), int(every[:, 1].max())

    def resize(self, size: int) -> str:
        """Hold the experts of this rank in a group of ``size`` (after leaving the old generation)."""
        done = replace_experts(self.runner.model, self.dispatcher, size, self.model_path)
        self.size, self.reform_to = size, 0
        return done.describe()

    def report(self, waiting: int, running: int) -> None:
        self.send(Report(self.rank, generation=self.status.generation, ready=self.ready, waiting=waiting,
                         running=running, wave_active=self.wave.active))

    def close(self) -> None:
        self.leave("shutting down")
        self.sock.close(linger=0)


class GroupMember:
    """The ``lbd.engine.core.process.CoreLoop`` of a rank in an MoE DP group: its core holds this member's
    experts (CUDA graphs off: a pass runs collectives), its loop is ``MemberServer``."""

    def __init__(self, args: EngineArgs, model_path: str) -> None:
        self.args, self.model_path = args, model_path
        self.member: Member | None = None

    def build(self, metrics: Any) -> EngineCore:
        args = self.args
        plan = ExpertPlan.from_args(args)
        shard = plan.shard(routed_experts(load_hf_config(self.model_path)))
        self.runner = ModelRunner.from_args(dataclasses.replace(args, enforce_eager=True), self.model_path,
                                            model_options={"expert_shard": shard})
        self.dispatcher = ExpertDispatcher(plan, shard, self.runner.torch_device)
        self.blocks = attach(self.runner.model, self.dispatcher)
        logger.info("DP member %d of %d holds %s", args.rank, args.data_parallel_size,
                    f"experts {shard.start}..{shard.stop - 1} of {shard.num_experts}" if plan.expert_parallel
                    else f"1/{plan.size} of every expert's intermediate dim ({shard.num_experts} experts)")
        return EngineCore.from_args(args, self.model_path, metrics=metrics, runner=self.runner)

    def server(self, core: EngineCore, ctx: zmq.Context, sock: zmq.Socket, state: LoopState) -> MemberServer:
        self.member = Member(self.args, self.runner, self.dispatcher, self.blocks, ctx, self.model_path)
        return MemberServer(core, sock, self.member, self.args.shutdown_timeout, state)

    def close(self) -> None:
        if self.member is not None:
            self.member.close()


class MemberServer(CoreServer):
    """CoreServer's front-end handling, with the group's loop (see the module docstring)."""

    def __init__(self, core: EngineCore, sock: zmq.Socket, member: Member, shutdown_timeout: float,
                 state: LoopState | None = None) -> None:
        super().__init__(core, sock, shutdown_timeout, state)
        self.member = member
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(member.sock, zmq.POLLIN)
        self._last_report = 0.0

    # ---- front ends -----------------------------------------------------------------------------------
    def handle(self, frames: list[bytes]) -> None:
        super().handle(frames)
        if len(frames) >= 2 and frames[1] == CM.HELLO:
            self._send_status(frames[0])

    def _add(self, ident: bytes, req: CM.EngineCoreRequest) -> None:
        status = self.member.status
        if status.state is not DPState.READY:
            self.send_error(ident, req.request_id, unavailable_message(status), 503)
            return
        super()._add(ident, req)

    def _send_status(self, ident: bytes | None = None) -> None:
        wave = self.member.wave
        msg = CM.encode(dataclasses.replace(self.member.status, wave_active=wave.active, waves=wave.waves,
                                            steps=wave.steps, dummy_steps=wave.dummy_steps))
        for peer in [ident] if ident is not None else list(self.state.peers):
            self.sock.send_multipart([peer, CM.DP, msg])

    def _fail_all(self, reason: str, message: str | None = None) -> None:
        """Every request in the core fails with 503 (its front end answers before the first byte, or ends
        the stream with an error event); their KV blocks are freed."""
        core, owner = self.core, self.state.owner
        ids = list(core.scheduler.requests)
        message = message or f"the data-parallel group lost a member ({reason}): retry"
        for rid in ids:
            ident = owner.pop(rid, None)
            if ident is not None:
                self.send_error(ident, rid, message, 503)
        core.abort(ids)
        core.scheduler.in_flight.clear()
        if ids:
            logger.warning("failed %d in-flight requests: %s", len(ids), reason)

    # ---- the coordinator ------------------------------------------------------------------------------
    def drain_coordinator(self) -> None:
        """Handle every queued coordinator message; a ``form`` that a later ``abort`` of the same generation
        already cancelled is skipped (forming it would wait for a member that is gone)."""
        sock, batch = self.member.sock, []
        while True:
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                batch.append(decode_from_coordinator(data))
            except UnknownKind as e:
                log_unknown_kind(logger, e)
            except ValueError as e:
                logger.warning("dropping a bad coordinator message: %s", e)
        aborted = {msg.generation for msg in batch if isinstance(msg, Abort)}
        for msg in batch:
            if isinstance(msg, Form) and msg.generation in aborted:
                continue
            self.on_coordinator(msg)

    def on_coordinator(self, msg: CoordinatorMessage) -> None:
        m, gen = self.member, msg.generation
        if isinstance(msg, Form) and msg.size != m.size:
            logger.warning("ignoring form of generation %d at %d ranks: this rank is in a group of %d", gen,
                           msg.size, m.size)
        elif isinstance(msg, Form) and not m.ready and gen > m.status.generation:
            self.member.status.reason = f"forming generation {gen}"
            problem = m.form(gen)
            if problem is not None:
                logger.warning("could not join generation %d: %s", gen, problem)
                m.send(Lost(m.rank, generation=gen, reason=problem))
                m.leave(problem)
            self._send_status()
        elif isinstance(msg, Abort) and m.ready and gen == m.status.generation:
            self._lose(f"the coordinator aborted generation {gen}: {msg.reason}", tell=False)
        elif isinstance(msg, StartWave) and m.ready and gen == m.status.generation:
            if m.wave.start(msg.wave):
                m.metrics.waves.inc()
                self._send_status()
        elif isinstance(msg, Reform) and m.ready and gen == m.status.generation and msg.size > 0:
            logger.info("generation %d re-forms at %d ranks: leaving it at the next idle check", gen,
                        msg.size)
            m.reform_to = msg.size  # a paused rank starts a wave (the loop steps while reform_to is set)

    def _lose(self, reason: str, tell: bool) -> None:
        m = self.member
        gen = m.status.generation
        logger.warning("DP group generation %d lost: %s; re-joining with the same process", gen, reason)
        self._fail_all(reason)
        m.leave(reason)
        if tell:
            m.send(Lost(m.rank, generation=gen, reason=reason))
        if m.reform_to:  # the coordinator re-forms at that size now
            self._reform(m.reform_to)
            return
        m.join_if_due(time.monotonic())
        self._send_status()

    # ---- the loop -------------------------------------------------------------------------------------
    def run(self) -> None:
        core, state, m = self.core, self.state, self.member
        next_stats = 0.0
        self._send_status()
        while not state.stop_now:
            stepping = m.ready and (m.wave.active or core.has_work() or m.reform_to > 0)
            if stepping:
                self.drain()
                self.drain_coordinator()
            else:
                if state.draining_since is not None and not core.has_work():
                    break
                for sock, _ in self.poller.poll(IDLE_POLL_MS):
                    self.drain() if sock is self.sock else self.drain_coordinator()
            now = time.monotonic()
            if state.draining_since is not None and now - state.draining_since > self.shutdown_timeout:
                logger.warning("shutdown timeout: exiting with %d requests unfinished",
                               len(core.scheduler.requests))
                break
            m.join_if_due(now)
            if m.ready and (m.wave.active or core.has_work() or m.reform_to > 0):
                self._wave_step(now)
            if now - self._last_report >= REPORT_INTERVAL_S:
                stats = core.stats()
                m.report(stats.num_waiting, stats.num_running)
                self._last_report = now
            if now >= next_stats:
                self.send_stats(now)
                next_stats = now + 0.1

    def _wave_step(self, now: float) -> None:
        core, m = self.core, self.member
        if not m.wave.active and m.wave.start():
            m.metrics.waves.inc()
            m.send(WaveStarted(m.rank, generation=m.status.generation, wave=m.wave.id))
            self._send_status()
        try:
            before = m.dispatcher.passes
            outputs = core.step() if core.has_work() else []
            dummy = m.dispatcher.passes == before
            if dummy:
                m.dummy_pass()
                m.metrics.dummy_steps.inc()
            m.metrics.steps.inc()
            self.send_outputs(outputs, now)
            if not m.wave.stepped(dummy):
                return
            busy, reform_to = m.idle_check(core.has_work())
            if reform_to:
                self._reform(reform_to)
            elif not busy:
                ended = m.wave.end()
                m.send(WaveEnded(m.rank, generation=m.status.generation, wave=ended))
                self._send_status()
        except GroupLost as e:
            self._lose(str(e), tell=True)

    def _reform(self, size: int) -> None:
        """Every member saw the resize at this step: leave the generation; drain out when this rank is
        beyond ``size``, else re-place the experts and join the next generation keeping the requests."""
        m = self.member
        gen = m.status.generation
        if m.rank >= size:
            why = f"rank {m.rank} left the data-parallel group (resized to {size} ranks)"
            self._fail_all(why, f"{why}: retry")
            m.leave(why)
            m.removed = m.status.reason = why
            logger.info("%s: generation %d left for good", why, gen)
        else:
            m.leave(f"re-forming at {size} ranks")
            try:
                done = m.resize(size)
            except ValueError as e:  # its experts do not split for that size (a tensor-parallel slice)
                why = f"rank {m.rank} cannot hold its experts in a group of {size} ranks: {e}"
                logger.error("%s: leaving the group for good", why)
                self._fail_all(why, f"{why}: retry")
                m.removed = m.status.reason = why
                self._send_status()
                return
            logger.info("left generation %d to re-form at %d ranks; %s; %d requests kept", gen, size, done,
                        len(self.core.scheduler.requests))
            m.join_if_due(time.monotonic())
        self._send_status()


def unavailable_message(status: DPStatus) -> str:
    return status.unavailable
