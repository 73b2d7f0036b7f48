"""The two threads beside the core loop that move KV blocks between ranks, over TCP through ZMQ.

``BlockServer`` (a producer): a ROUTER socket on ``kv_ip:kv_port``; each ``KVPull`` names a lease (the
blocks a finished prefill left held for its decode) and the blocks wanted; the answer is a header and the
blocks' bytes. A lease is served once: then its blocks go back to the core (``done``), which releases them.
With NIXL (``lbd.engine.kv_transfer.nixl``) the answer says where to READ the blocks instead, and the lease
ends on the READ's notification.
``BlockPuller`` (a consumer): one DEALER per pull, a deadline, an answer capped in size (ZMQ's MAXMSGSIZE);
whatever goes wrong (timeout, producer gone, wrong layout, no proof that the producer holds the transfer key:
``lbd.engine.kv_transfer.trust``) comes back as a failed ``PullResult``, and the core recomputes that prefill
itself. Beyond loopback both ends are CURVE-secured with keys derived from the
cluster token (``lbd.common.cluster``), so only token holders read anyone's KV.

Why ZMQ TCP and not shared memory: the ranks of a P/D pair are on different hosts as often as not, one
transport serves both, and on one host the copy out of the cache and into the other costs more than the
loopback hop (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import hmac
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from lbd.common.cluster import secure_zmq_client, secure_zmq_server
from lbd.engine.kv_transfer.trust import proof
from lbd.wire import kv_transfer as KT

if TYPE_CHECKING:
    from lbd.engine.kv_transfer.nixl import NixlSink, NixlSource

logger = logging.getLogger(__name__)

PURPOSE = "kv-transfer"
POLL_MS = 100
MAX_PULL_REQUEST_BYTES = 1 << 20  # a KVPull is a few ids: anything larger is not one
NIXL_POLL_MS = 5  # a NIXL producer's wait for pulls between reads of its READ notifications, none in flight
NIXL_PROGRESS_S = 0.0002  # its pause between two progress calls while READs are in flight (yields the GIL)
ANSWER_SLACK = 1 << 16  # an answer's bytes beyond its blocks: the header, or a NixlRemote's metadata
UNPROVEN = "unauthenticated producer"  # a PullResult.error's start when the producer gave no proof


@dataclass(slots=True)
class Lease:
    block_ids: list[int]
    deadline: float  # time.monotonic()
    token_ids: list[int]  # the prompt tokens the blocks hold (block_size each)
    lent: int = 0  # blocks a NIXL consumer is reading (held until its notification or the deadline)
    notif: str = ""  # the lend's secret: the READ's notification must carry it to end the lease


class Leases:
    """Blocks held for pulls, by transfer id; shared by the core thread and the server thread. At most
    ``max_count`` leases and ``max_blocks`` blocks at once: a flood of prefills for remote decodes (any
    client that reaches the rank can send them) never holds more of the cache than that."""

    def __init__(self, max_count: int = 1 << 30, max_blocks: int = 1 << 62) -> None:
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self.max_count, self.max_blocks = max_count, max_blocks
        self.blocks = 0  # blocks held under all leases
        self.done: queue.SimpleQueue[list[int]] = queue.SimpleQueue()  # served: the core releases them

    def add(self, transfer_id: str, block_ids: list[int], deadline: float, token_ids: list[int]
            ) -> str | None:
        """Hold a lease; None, or why not ("count", "bytes": a cap reached; "taken": the id is in use)."""
        with self._lock:
            if transfer_id in self._leases:
                return "taken"
            if len(self._leases) >= self.max_count:
                return "count"
            if self.blocks + len(block_ids) > self.max_blocks:
                return "bytes"
            self._leases[transfer_id] = Lease(block_ids, deadline, token_ids)
            self.blocks += len(block_ids)
            return None

    def _pop(self, transfer_id: str) -> Lease:
        lease = self._leases.pop(transfer_id)
        self.blocks -= len(lease.block_ids)
        return lease

    def lend(self, transfer_id: str, blocks: int, deadline: float) -> Lease | None:
        """Mark a lease as being read over NIXL (once: a second pull finds none); it stays held until
        ``take`` (the READ's notification, carrying the lend's ``notif``) or ``deadline``, pushed out so no
        block is freed under a READ."""
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is None or lease.lent:
                return None
            lease.lent, lease.deadline = max(1, blocks), max(lease.deadline, deadline)
            lease.notif = secrets.token_hex(16)
            return lease

    def take(self, transfer_id: str, notif: str | None = None) -> Lease | None:
        """End a lease; with ``notif``, only a lent one whose lend's secret it is (a NIXL notification)."""
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is None or (notif is not None and not (
                    lease.notif and hmac.compare_digest(lease.notif.encode(), notif.encode()))):
                return None
            return self._pop(transfer_id)

    def expired(self, now: float) -> list[list[int]]:
        """Pop the leases past their deadline; their blocks, for the core to release."""
        with self._lock:
            gone = [tid for tid, lease in self._leases.items() if lease.deadline <= now]
            return [self._pop(tid).block_ids for tid in gone]

    def lending(self) -> bool:
        """Whether a NIXL READ may be in flight (a lease lent and not yet ended)."""
        with self._lock:
            return any(lease.lent for lease in self._leases.values())

    def __len__(self) -> int:
        return len(self._leases)


class BlockServer(threading.Thread):
    """Serves leased blocks to consumers; ``read`` turns block ids into bytes (``KVBlockIO.read``)."""

    def __init__(self, ctx: zmq.Context, host: str, port: int, token: str | None, engine_id: str,
                 leases: Leases, read: Callable[[list[int]], memoryview], layout: str, block_bytes: int,
                 on_served: Callable[[int], None], nixl: NixlSource | None = None,
                 read_grace_s: float = 60.0, key: bytes | None = None) -> None:
        super().__init__(name="kv-block-server", daemon=True)
        self.engine_id, self.leases, self.read, self.key = engine_id, leases, read, key
        self.layout, self.block_bytes, self.on_served = layout, block_bytes, on_served
        self.nixl, self.read_grace_s = nixl, read_grace_s
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_PULL_REQUEST_BYTES)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        secure_zmq_server(self.sock, token, PURPOSE)
        bare = f"[{host}]" if ":" in host and not host.startswith("[") else host
        if port:
            self.sock.bind(f"tcp://{bare}:{port}")
            self.port = port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{bare}")
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                reading = self.nixl is not None and self.leases.lending()
                if self.sock.poll(0 if reading else POLL_MS if self.nixl is None else NIXL_POLL_MS):
                    frames = self.sock.recv_multipart()
                    if len(frames) == 2:
                        self._serve(frames[0], frames[1])
                if self.nixl is not None:  # reading its notifications also progresses NIXL's transfers
                    self._read_done(self.nixl.released())
                    if reading:
                        time.sleep(NIXL_PROGRESS_S)
        except zmq.ZMQError as e:
            if not self._halt.is_set():
                logger.error("KV block server stopped: %s", e)
        finally:
            self.sock.close(linger=0)
            if self.nixl is not None:
                self.nixl.close()

    def _read_done(self, released: list[tuple[str, str]]) -> None:
        """NIXL READs that finished: their leases end, the blocks go back to the core. A notification ends
        a lease only with the secret its lend handed the reader (any NIXL peer can send notifications)."""
        for tid, notif in released:
            lease = self.leases.take(tid, notif)
            if lease is not None:
                self.leases.done.put(lease.block_ids)
                self.on_served(lease.lent)

    def _serve(self, ident: bytes, payload: bytes) -> None:
        try:
            pull = KT.decode_pull(payload)
        except ValueError:
            return  # not a pull: nothing to answer
        header, data = self._answer(pull)
        if self.key is not None and pull.challenge:
            header.proof = proof(self.key, pull.challenge, pull.transfer_id)
        self.sock.send_multipart([ident, KT.encode(header), data], copy=False)
        if header.ok:
            self.on_served(len(pull.block_ids))

    def _answer(self, pull: KT.KVPull) -> tuple[KT.KVBlocksHeader, bytes | memoryview]:
        def no(error: str) -> tuple[KT.KVBlocksHeader, bytes | memoryview]:
            return KT.KVBlocksHeader(pull.transfer_id, False, error), b""

        if pull.engine_id != self.engine_id:
            return no(f"engine {pull.engine_id} is not this one ({self.engine_id}): restarted?")
        if pull.transport == "nixl" and self.nixl is not None and pull.block_ids:
            return self._lend(pull, no)
        lease = self.leases.take(pull.transfer_id)
        if lease is None:
            return no(f"no blocks held for {pull.transfer_id} (pulled already, or past the lease)")
        try:
            problem = _mismatch(pull, lease)
            if problem:
                return no(problem)
            data = self.read(pull.block_ids)
        finally:
            self.leases.done.put(lease.block_ids)
        return KT.KVBlocksHeader(pull.transfer_id, True, layout=self.layout, block_bytes=self.block_bytes,
                                 num_blocks=len(pull.block_ids)), data

    def _lend(self, pull: KT.KVPull, no: Callable[[str], tuple[KT.KVBlocksHeader, bytes]]
              ) -> tuple[KT.KVBlocksHeader, bytes | memoryview]:
        """A NIXL consumer's pull: the same checks, then where to READ instead of the bytes."""
        assert self.nixl is not None
        lease = self.leases.lend(pull.transfer_id, len(pull.block_ids), time.monotonic() + self.read_grace_s)
        if lease is None:
            return no(f"no blocks held for {pull.transfer_id} (pulled already, or past the lease)")
        problem = _mismatch(pull, lease)
        if problem:
            if self.leases.take(pull.transfer_id) is not None:  # as for bytes: a pull that does not fit
                self.leases.done.put(lease.block_ids)                # ends the lease
            return no(problem)
        remote = self.nixl.remote(pull.nixl_known)
        remote.notif = lease.notif
        return KT.KVBlocksHeader(pull.transfer_id, True, layout=self.layout, block_bytes=self.block_bytes,
                                 num_blocks=len(pull.block_ids), transport="nixl"), KT.encode(remote)

    def stop(self) -> None:
        self._halt.set()


def _mismatch(pull: KT.KVPull, lease: Lease) -> str | None:
    """Why ``pull`` may not have these blocks: they must be the lease's blocks that end where the consumer's
    tokens end, and its tokens must be the ones the prefill computed them from."""
    if not pull.block_ids:
        return None  # a release: nothing is read
    n, held = len(pull.token_ids), len(lease.token_ids) // max(1, len(lease.block_ids))
    end = n // held if held else 0
    if not held or n % held or end > len(lease.block_ids) or len(pull.block_ids) > end:
        return "the blocks asked for are not this transfer's"
    if lease.block_ids[end - len(pull.block_ids):end] != pull.block_ids:
        return "the blocks asked for are not this transfer's"
    if lease.token_ids[:n] != pull.token_ids:
        return "the prompt differs from the one prefilled: its KV does not apply"
    return None


@dataclass(slots=True)
class PullJob:
    request_id: str  # the consumer's request
    host: str
    port: int
    engine_id: str
    transfer_id: str
    block_ids: list[int]  # the producer's, in position order
    first: int  # position (in blocks) of the first one in the prompt
    token_ids: list[int]  # the consumer's prompt through the last block wanted (the producer checks them)


@dataclass(slots=True)
class PullResult:
    job: PullJob
    data: bytes | None  # None: failed
    error: str = ""
    seconds: float = 0.0
    nixl: bool = False  # the blocks came by a NIXL READ


class BlockPuller(threading.Thread):
    """Runs pulls one after another; results go to ``results`` for the core thread. ``pace`` (sim ranks:
    ``lbd.engine.kv_transfer.sim``) gives a pull of n blocks its modelled duration, waited out before the
    result is handed over."""

    def __init__(self, ctx: zmq.Context, token: str | None, layout: str, block_bytes: int, timeout_s: float,
                 max_bytes: int, pace: Callable[[int], float] | None = None, nixl: NixlSink | None = None,
                 key: bytes | None = None) -> None:
        super().__init__(name="kv-block-puller", daemon=True)
        self.key = key  # a producer must prove it holds it (lbd.engine.kv_transfer.trust); None: no pulls
        self.ctx, self.token, self.layout, self.block_bytes = ctx, token, layout, block_bytes
        self.timeout_s, self.max_bytes, self.pace, self.nixl = timeout_s, max_bytes, pace, nixl
        self.jobs: queue.SimpleQueue[PullJob | None] = queue.SimpleQueue()
        self.results: queue.SimpleQueue[PullResult] = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            t0 = time.monotonic()
            try:
                data, error, nixl = self._pull(job)
            except zmq.ZMQError as e:
                data, error, nixl = None, f"zmq: {e}", False
            if self.pace is not None and data is not None and job.block_ids:
                time.sleep(max(0.0, t0 + self.pace(len(job.block_ids)) - time.monotonic()))
            self.results.put(PullResult(job, data, error, time.monotonic() - t0, nixl))

    def _pull(self, job: PullJob) -> tuple[bytes | None, str, bool]:
        """The blocks' bytes or None, why not, and whether they came over NIXL. Only from a producer that
        proves it holds the transfer key: whatever else listens there is never read from."""
        if self.key is None:
            return None, f"{UNPROVEN}: this rank has no transfer key", False
        sock = self.ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE,
                            min(self.max_bytes, len(job.block_ids) * self.block_bytes + ANSWER_SLACK))
            secure_zmq_client(sock, self.token, PURPOSE)
            host = f"[{job.host}]" if ":" in job.host and not job.host.startswith("[") else job.host
            sock.connect(f"tcp://{host}:{job.port}")
            nixl, challenge = self.nixl, secrets.token_bytes(16)
            sock.send(KT.encode(KT.KVPull(
                job.engine_id, job.transfer_id, job.block_ids, job.token_ids,
                transport="bytes" if nixl is None else "nixl",
                nixl_known=nixl is not None and nixl.knows(job.engine_id), challenge=challenge)))
            if not sock.poll(int(self.timeout_s * 1000)):
                return None, f"no answer from {job.host}:{job.port} in {self.timeout_s:g} s", False
            frames = sock.recv_multipart(copy=True)
        finally:
            sock.close(linger=0)
        if len(frames) != 2:
            return None, f"a malformed answer ({len(frames)} frames)", False
        header = KT.decode_header(frames[0])
        if not header.ok:
            return None, header.error, False
        want = proof(self.key, challenge, job.transfer_id)
        if not hmac.compare_digest(header.proof.encode(), want.encode()):
            return None, f"{UNPROVEN}: {job.host}:{job.port} did not prove it holds the transfer key", False
        if header.layout != self.layout:
            return None, f"the producer's KV layout {header.layout} is not this rank's {self.layout}", False
        if header.transport == "nixl" and self.nixl is not None:
            data, error = self._read(job, frames[1])
            return data, error, True
        if header.transport != "bytes" or len(frames[1]) != len(job.block_ids) * self.block_bytes:
            return None, f"a malformed answer ({header.transport}, {len(frames[1])} bytes)", False
        return frames[1], "", False

    def _read(self, job: PullJob, remote: bytes) -> tuple[bytes | None, str]:
        """The blocks READ over NIXL from where the producer said they are."""
        from lbd.engine.kv_transfer.nixl import NixlError

        assert self.nixl is not None
        try:
            where = KT.decode_nixl_remote(remote)
            return self.nixl.read(job.engine_id, where, job.block_ids, job.transfer_id, self.timeout_s), ""
        except NixlError as e:
            return None, f"nixl: {e}"
        except Exception as e:  # NIXL's own errors, a malformed NixlRemote: this pull fails, not the thread
            return None, f"nixl: {type(e).__name__}: {e}"

    def stop(self) -> None:
        self.jobs.put(None)
