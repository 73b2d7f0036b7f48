"""The core's side of prefill/decode disaggregation (``--kv-transfer-config``).

A producer's prefill (``do_remote_decode``) finishes as usual, but its full prompt blocks stay held under a
lease, and its output carries the ``kv_transfer_params`` a decode needs. A consumer's request with
``do_remote_prefill`` looks up its own prefix cache first: only the blocks it lacks are pulled; meanwhile the
request waits parked in the scheduler (admitted, not schedulable). When the blocks come they are written into
fresh blocks and registered in the prefix cache (KV events published), and the request is unparked: its
first step finds them there and computes only the tail. A failed or late pull unparks it all the same, and
the prefill is recomputed: slower, never wrong, never lost. Leases nobody pulled are freed after ``lease_s``.

Trust (``lbd.engine.kv_transfer.trust``, ARCHITECTURE.md "P/D trust model"): a producer signs the params it
hands out and holds at most ``max_leases`` leases and ``max_lease_bytes`` of blocks (a prefill beyond either
gets params with no blocks, counted as a refusal); a consumer pulls only for params signed with its transfer
key, from a producer that proves it holds the key, and resolves no name on the core thread.
A ``--device sim`` rank runs all of this with modelled blocks (``lbd.engine.kv_transfer.sim``).
"""

from __future__ import annotations

import logging
import queue
import socket
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from lbd.common.cluster import is_loopback, is_wildcard, read_cluster_token, resolve_bind
from lbd.engine.config.kv_transfer import KVTransferConfig, parse_kv_transfer_config
from lbd.engine.core.engine_core import EngineCore
from lbd.engine.core.request import Request
from lbd.engine.core.scheduler import Scheduler
from lbd.engine.kv_transfer.agent import UNPROVEN, BlockPuller, BlockServer, Leases, PullJob, PullResult
from lbd.engine.kv_transfer.metrics import KVTransferMetrics
from lbd.engine.kv_transfer.trust import numeric_loopback, sign, signed, transfer_key
from lbd.wire.core_messages import EngineCoreOutput
from lbd.wire.kv_transfer import KVTransferParams

if TYPE_CHECKING:
    from lbd.engine.kv_transfer.blocks import KVBlockIO
    from lbd.engine.kv_transfer.nixl import NixlSink, NixlSource
    from lbd.engine.kv_transfer.sim import SimBlockIO

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005  # how long a step with only parked requests waits for a pull to land


def _advertised_host(kv_ip: str) -> str:
    """Where decode ranks reach the block server, as an address (consumers resolve no names): ``kv_ip``, or
    for a wildcard this host's address. Resolved once, at start."""
    try:
        if not is_wildcard(kv_ip):
            return resolve_bind(kv_ip)[1]
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def attach(core: EngineCore) -> None:
    """Give ``core`` the connector of its ``--kv-transfer-config`` (nothing when unset); starts its threads.
    On failure the core is closed and the error raised."""
    config = core.engine_config
    if config.cache.kv_transfer_config is None:
        return
    try:
        core.kv_transfer = KVTransfer(parse_kv_transfer_config(config.cache.kv_transfer_config),
                                      config.parallel.rank, block_io(core), core.scheduler,
                                      core.metrics.labels if core.metrics is not None else None,
                                      core.flush_kv_events)
    except Exception:
        core.close()
        raise


def block_io(core: EngineCore) -> KVBlockIO | SimBlockIO:
    """The blocks' bytes of ``core``'s runner: its KV tensors, or a sim rank's modelled blocks."""
    runner = core.runner
    if getattr(runner, "device", "") == "sim":
        from lbd.engine.kv_transfer.sim import SimBlockIO

        return SimBlockIO(runner.profile, core.scheduler.kv.block_size)  # type: ignore[attr-defined]
    kv_caches = getattr(runner, "kv_caches", None)
    if not kv_caches:
        raise ValueError("--kv-transfer-config needs a one-device rank with a KV cache (not tensor/pipeline "
                         "parallel)")
    from lbd.engine.kv_transfer.blocks import KVBlockIO

    return KVBlockIO(kv_caches)


class KVTransfer:
    def __init__(self, cfg: KVTransferConfig, rank: int, io: KVBlockIO | SimBlockIO, scheduler: Scheduler,
                 labels: dict[str, str] | None, flush_events: Callable[[], None]) -> None:
        self.cfg, self.scheduler, self.kv = cfg, scheduler, scheduler.kv
        self.block_size = scheduler.kv.block_size
        self.flush_events = flush_events
        self.engine_id = cfg.engine_id or uuid.uuid4().hex
        self.io = io
        self.metrics = KVTransferMetrics(labels, self.io.block_bytes, self.block_size)
        lease_bytes = cfg.max_lease_bytes or self.kv.num_blocks * self.io.block_bytes // 2
        self.leases = Leases(cfg.max_leases, lease_bytes // max(1, self.io.block_bytes))
        self.params_out: dict[str, KVTransferParams] = {}
        self.parked: dict[str, int] = {}  # consumer request id -> first block index being pulled
        token = read_cluster_token(None)
        self.secured = token is not None
        self.key = transfer_key()  # signs the params this rank hands out, checks the ones it pulls for
        self.ctx = zmq.Context(io_threads=1)
        self.server: BlockServer | None = None
        self.puller: BlockPuller | None = None
        self.host = _advertised_host(cfg.kv_ip)
        source, sink = self._nixl(io) if cfg.kv_connector == "NixlConnector" else (None, None)
        if cfg.produces:
            self.server = BlockServer(self.ctx, cfg.kv_ip, cfg.port_for(rank), token, self.engine_id,
                                      self.leases, self.io.read, self.io.layout, self.io.wire_block_bytes,
                                      self.metrics.served, source, cfg.lease_s, self.key)
            self.server.start()
        if cfg.consumes:
            self.puller = BlockPuller(self.ctx, token, self.io.layout, self.io.wire_block_bytes,
                                      cfg.pull_timeout_s, cfg.max_pull_bytes,
                                      getattr(self.io, "transfer_seconds", None), sink, self.key)
            self.puller.start()
        scheduler.on_finish = self.on_finish
        logger.info("KV transfer: %s, engine id %s, %s, %d bytes per token", cfg.kv_role, self.engine_id,
                    f"blocks served on {self.host}:{self.server.port}" if self.server else "no block server",
                    self.io.block_bytes // self.block_size)

    def _nixl(self, io: KVBlockIO | SimBlockIO) -> tuple[NixlSource | None, NixlSink | None]:
        """NixlConnector's two ends for this rank's roles (lbd.engine.kv_transfer.nixl)."""
        from lbd.engine.kv_transfer.blocks import KVBlockIO
        from lbd.engine.kv_transfer.nixl import NixlSink, NixlSource

        if not isinstance(io, KVBlockIO):
            raise ValueError("--kv-transfer-config: NixlConnector moves real KV blocks; a --device sim rank "
                             "models transfers with LbdConnector")
        loopback = is_loopback(self.cfg.kv_ip)
        return (NixlSource(io, self.engine_id, loopback) if self.cfg.produces else None,
                NixlSink(io, self.engine_id, loopback) if self.cfg.consumes else None)

    def advertised(self) -> dict[str, Any]:
        """What /status and the router learn: role, engine id, where blocks are served."""
        return {"kv_role": self.cfg.kv_role, "engine_id": self.engine_id, "host": self.host,
                "port": self.server.port if self.server else None,
                "bytes_per_token": self.io.block_bytes // self.block_size}

    # ---- producer -------------------------------------------------------------------------------------
    def on_finish(self, req: Request) -> None:
        """The scheduler's finish hook, before the blocks are freed: a prefill for a remote decode keeps its
        full prompt blocks under a lease and leaves the params for its output."""
        params = req.kv_transfer_params
        if (self.server is None or params is None or not params.do_remote_decode
                or req.finish_reason not in ("length", "stop")):
            return
        blocks = list(req.block_ids[:min(req.num_prompt_tokens, req.num_computed_tokens) // self.block_size])
        if blocks:
            refused = self.leases.add(req.request_id, blocks, time.monotonic() + self.cfg.lease_s,
                                      req.prompt_token_ids[:len(blocks) * self.block_size])
            if refused is None:
                self.kv.hold(blocks)
            else:  # a cap reached: the decode recomputes this prefill; the cache stays free for others
                if refused != "taken":
                    (self.metrics.refused_bytes if refused == "bytes" else self.metrics.refused_count).inc()
                logger.debug("no lease for %s (%s): its decode recomputes", req.request_id, refused)
                blocks = []
            self.metrics.pending.set(len(self.leases))
            self.metrics.held.set(self.leases.blocks)
        params = KVTransferParams(
            do_remote_prefill=True, remote_engine_id=self.engine_id, remote_block_ids=blocks,
            remote_host=self.host, remote_port=self.server.port, remote_request_id=req.request_id, tp_size=1)
        self.params_out[req.request_id] = sign(self.key, params) if self.key is not None else params

    def attach(self, outputs: list[EngineCoreOutput]) -> None:
        """Put each finished prefill's params on its last output."""
        if not self.params_out:
            return
        for o in outputs:
            if o.finish_reason is not None:
                params = self.params_out.pop(o.request_id, None)
                if params is not None:
                    o.kv_transfer_params = params

    # ---- consumer -------------------------------------------------------------------------------------
    def admit(self, req: Request) -> bool:
        """Queue ``req``; True when its blocks are being pulled (it waits parked), False when the caller
        queues it as usual (no remote prefill, or every block is here already)."""
        params = req.kv_transfer_params
        if self.puller is None or params is None or not params.do_remote_prefill:
            return False
        remote = params.block_ids()
        if not signed(self.key, params):
            # no producer this rank shares the key with named that address: never contact it
            logger.warning("not pulling KV for %s: its kv_transfer_params are not signed by a producer this "
                           "rank trusts (%s): recomputing its prefill", req.request_id,
                           "no transfer key here" if self.key is None else "signature missing or wrong")
            self.metrics.untrusted.inc()
            return False
        host = "127.0.0.1" if params.remote_host == "localhost" else params.remote_host or ""
        if not self.secured and not numeric_loopback(host):
            # without the cluster token (CURVE) only loopback is pulled from; nothing is resolved here
            logger.warning("not pulling KV for %s from %s (beyond loopback and no LBD_CLUSTER_TOKEN): "
                           "recomputing its prefill", req.request_id, host)
            self.metrics.failed.inc()
            return False
        want = min((req.num_tokens - 1) // self.block_size, len(remote))
        have = len(self.kv.get_computed_prefix(req)[0])
        job = PullJob(req.request_id, host, params.remote_port or 0, params.remote_engine_id or "",
                      params.remote_request_id or "", [], have, [])
        if not remote:
            return False  # the producer held nothing (a lease cap): nothing to pull, nothing to free
        if have >= want:
            job.request_id = ""  # nothing to move: only tell the producer to free its lease
            self.puller.jobs.put(job)
            self.metrics.local_blocks.inc(want)
            return False
        job.block_ids = remote[have:want]
        job.token_ids = req.prompt_token_ids[:want * self.block_size]
        self.scheduler.add_request(req, parked=True)
        self.parked[req.request_id] = have
        self.puller.jobs.put(job)
        self.metrics.local_blocks.inc(have)
        return True

    def _land(self, result: PullResult) -> None:
        job = result.job
        if not job.request_id or self.parked.pop(job.request_id, None) is None:
            return  # a release notice, or the request was aborted meanwhile
        req = self.scheduler.parked.get(job.request_id)
        if req is not None:
            if result.data is None:
                self.metrics.failed.inc()
                if result.error.startswith(UNPROVEN):
                    self.metrics.untrusted.inc()
                logger.warning("KV pull for %s failed (%s): recomputing its prefill", job.request_id,
                               result.error)
            elif not self._import(req, job, result.data):
                self.metrics.failed.inc()
            else:
                self.metrics.pulled(len(job.block_ids), len(job.block_ids) * self.io.block_bytes,
                                    result.seconds, result.nixl)
            self.scheduler.unpark(job.request_id)

    def _import(self, req: Request, job: PullJob, data: bytes) -> bool:
        """Write the pulled blocks into fresh blocks and register them in the prefix cache; False when the
        chain cannot be completed (the local prefix shrank meanwhile, or no room)."""
        local = self.kv.get_computed_prefix(req)[0]
        if len(local) < job.first:
            return False
        end = job.first + len(job.block_ids)
        local = local[:end]
        holder = Request(f"{req.request_id}#kv", req.prompt_token_ids, req.sampling, None, 0.0)
        holder.block_hashes = list(req.block_hashes[:end])
        holder.num_cached_tokens = 0  # not a prefix-cache query of its own
        if not self.kv.allocate_for(holder, (end - len(local)) * self.block_size, local):
            return False
        skip = len(local) - job.first
        new = holder.block_ids[len(local):end]
        self.io.write(new, memoryview(data)[skip * self.io.block_bytes:])
        holder.num_computed_tokens = end * self.block_size
        self.kv.cache_blocks(holder)
        self.kv.free(holder)
        return True

    # ---- upkeep ---------------------------------------------------------------------------------------
    def poll(self, wait: bool = False) -> None:
        """Release served and expired leases; land finished pulls (waiting briefly when ``wait``)."""
        kv, leases = self.kv, self.leases
        while True:
            try:
                kv.release(leases.done.get_nowait())
            except queue.Empty:
                break
        expired = leases.expired(time.monotonic())
        for blocks in expired:
            kv.release(blocks)
        if expired:
            self.metrics.expired.inc(len(expired))
        self.metrics.pending.set(len(leases))
        self.metrics.held.set(leases.blocks)
        if self.puller is None:
            return
        results = self.puller.results
        landed = False
        try:
            result = results.get(timeout=IDLE_WAIT_S) if wait and self.parked else results.get_nowait()
            while True:
                self._land(result)
                landed = True
                result = results.get_nowait()
        except queue.Empty:
            pass
        if landed:
            self.flush_events()
        self.metrics.pulls_waiting.set(len(self.parked))

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server.join(timeout=1.0)
        if self.puller is not None:
            self.puller.stop()
            self.puller.join(timeout=self.cfg.pull_timeout_s + 1.0)
        self.ctx.term()
