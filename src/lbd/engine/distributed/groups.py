"""torch.distributed groups of one layout and the collectives models and workers call.

The rendezvous is a TCPStore: the process that drives the group (an engine core) hosts it with
``host_store`` on a port the OS picks, and every member joins with ``init_process_groups``. Members use a
store prefix per ``generation``, so after a member dies the survivors can ``destroy()`` and join a new group
on the same store with ``generation + 1``. ``timeout_s`` (``--distributed-timeout-s``) bounds every collective
and the rendezvous: a peer that hangs or dies makes the others raise instead of waiting forever.

Backends: gloo on the CPU, NCCL on CUDA (each member sets its device first). Every TP group of the world is
created by every member in the same order (group creation is collective). Point-to-point transfers between
pipeline stages use the world group. On the CPU a TP group's all-reduces go through shared memory
(``lbd.engine.distributed.shm``; gloo's loopback TCP costs milliseconds a call: benchmarks/RESULTS.md,
"CPU all-reduce") when the tensor fits a slot.

Collectives are timed (``CommTimes``) so the executor can report the share of a step spent in them; on CUDA
the timer must synchronize, so it is off unless ``timed`` is passed (and it is off during CUDA-graph capture).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from lbd.common.cluster import is_loopback, listen_socket, loopback_interface
from lbd.engine.config.layout import ParallelLayout
from lbd.engine.distributed import shm as shm_ring


@dataclass(slots=True)
class CommTimes:
    """Seconds spent in collectives since the last reset (only while ``enabled``)."""

    enabled: bool = True
    tp_s: float = 0.0  # all-reduce / gather inside a TP group
    pp_recv_s: float = 0.0  # waiting for the previous stage's activations (the pipeline bubble, mostly)
    pp_send_s: float = 0.0
    calls: int = 0

    def snapshot(self) -> dict[str, float]:
        return {"tp_s": self.tp_s, "pp_recv_s": self.pp_recv_s, "pp_send_s": self.pp_send_s,
                "calls": self.calls}

    def reset(self) -> None:
        self.tp_s = self.pp_recv_s = self.pp_send_s = 0.0
        self.calls = 0


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def host_store(host: str, timeout_s: float, port: int = 0) -> dist.TCPStore:
    """The rendezvous server on ``host`` only (port 0: the OS picks one; read it from ``.port``).

    torch's TCPStore server listens on every interface whatever host it is given, so the socket is bound
    here and handed over (``master_listen_fd``): a store on loopback is reachable from this machine only."""
    sock = listen_socket(host, port)
    bound = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the descriptor from here on
    try:
        return dist.TCPStore(host, bound, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s), master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def pin_loopback_transport(address: str) -> None:
    """When the group meets on loopback (every member on this machine), gloo's and NCCL's own sockets listen
    on the loopback interface too, not on the address the host name resolves to (unless the user chose)."""
    if is_loopback(address):
        name = loopback_interface()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", name)


@dataclass(slots=True)
class ProcessGroups:
    layout: ParallelLayout
    rank: int  # world rank
    device: torch.device
    tp_group: dist.ProcessGroup | None  # None when tp_size == 1
    tp_root: int  # world rank of TP rank 0 of this stage
    times: CommTimes = field(default_factory=CommTimes)
    shm: shm_ring.ShmAllReduce | None = None  # the TP group's shared-memory all-reduce (CPU)
    _pending_sends: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)

    @property
    def _sync(self) -> bool:
        return self.device.type == "cuda"

    def _clock(self) -> float:
        if self._sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ---- tensor parallel ---------------------------------------------------------------------------------
    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the TP group, in place."""
        if self.tp_group is None:
            return x
        t0 = self._start()
        if self.shm is not None and self.shm.fits(x):
            self.shm.all_reduce(x)
        else:
            dist.all_reduce(x, group=self.tp_group)
        self._add_tp(t0)
        return x

    def tp_all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every TP rank's ``x`` concatenated along ``dim`` (shapes must match), on every TP rank."""
        if self.tp_group is None:
            return x
        t0 = self._start()
        parts = [torch.empty_like(x) for _ in range(self.layout.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        self._add_tp(t0)
        return torch.cat(parts, dim=dim)

    def tp_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every TP rank's ``x`` concatenated along ``dim`` on TP rank 0; None on the others."""
        if self.tp_group is None:
            return x
        t0 = self._start()
        root = self.rank == self.tp_root
        parts = [torch.empty_like(x) for _ in range(self.layout.tp_size)] if root else None
        dist.gather(x.contiguous(), parts, dst=self.tp_root, group=self.tp_group)
        self._add_tp(t0)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def _start(self) -> float:
        return self._clock() if self.times.enabled else 0.0

    def _add_tp(self, t0: float) -> None:
        if self.times.enabled:
            self.times.tp_s += self._clock() - t0
            self.times.calls += 1

    # ---- pipeline parallel -------------------------------------------------------------------------------
    def pp_send(self, x: torch.Tensor) -> None:
        """Send ``x`` to the same TP rank of the next stage without waiting for it to be received (at most
        ``pp_size`` sends stay pending, so the stage can start on its next batch)."""
        t0 = time.perf_counter()
        _, pp, tp = self.layout.coords(self.rank)
        dst = self.layout.world_rank(pp + 1, tp)
        pending = self._pending_sends
        while len(pending) >= self.layout.pp_size:
            pending.pop(0)[0].wait()
        work = dist.isend(x.contiguous(), dst)
        pending.append((work, x))
        if self.times.enabled:
            self.times.pp_send_s += time.perf_counter() - t0

    def pp_recv(self, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` from the same TP rank of the previous stage."""
        t0 = time.perf_counter()
        _, pp, tp = self.layout.coords(self.rank)
        dist.recv(out, self.layout.world_rank(pp - 1, tp))
        if self.times.enabled:
            self.times.pp_recv_s += time.perf_counter() - t0
        return out

    def flush_sends(self) -> None:
        for work, _ in self._pending_sends:
            work.wait()
        self._pending_sends.clear()

    # ---- whole world ---------------------------------------------------------------------------------------
    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(x, src)
        return x

    def barrier(self) -> None:
        dist.barrier()

    def destroy(self) -> None:
        """Leave the group (every member calls it); a new ``init_process_groups`` may follow."""
        self._pending_sends.clear()
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if dist.is_initialized():
            dist.destroy_process_group()


def init_process_groups(layout: ParallelLayout, pp_rank: int, tp_rank: int, *, address: str, port: int,
                        device: torch.device, timeout_s: float, generation: int = 0,
                        timed: bool | None = None) -> ProcessGroups:
    """Join the world of ``layout`` as (``layout.dp_rank``, ``pp_rank``, ``tp_rank``) through the TCPStore at
    ``address:port`` and create every TP group. ``timed`` defaults to on for the CPU only."""
    timeout = timedelta(seconds=timeout_s)
    pin_loopback_transport(address)
    store = dist.PrefixStore(f"lbd/{generation}",
                             dist.TCPStore(address, port, is_master=False, timeout=timeout))
    rank = layout.world_rank(pp_rank, tp_rank)
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=layout.world_size,
                            timeout=timeout)
    tp_group = None
    for ranks in layout.all_tp_groups():
        group = dist.new_group(ranks, timeout=timeout) if layout.tp_size > 1 else None
        if rank in ranks:
            tp_group = group
    times = CommTimes(enabled=device.type == "cpu" if timed is None else timed)
    groups = ProcessGroups(layout, rank, device, tp_group, layout.world_rank(pp_rank, 0), times)
    if tp_group is not None and device.type == "cpu" and shm_ring.available():
        groups.shm = _join_shm(store, tp_group, layout, pp_rank, tp_rank, timeout_s)
    return groups


def _join_shm(store: dist.Store, group: dist.ProcessGroup, layout: ParallelLayout, pp_rank: int, tp_rank: int,
              timeout_s: float) -> shm_ring.ShmAllReduce:
    """TP rank 0 creates the segment and names it in the store; once every member has it mapped, the name
    is removed (nothing is left in /dev/shm, however the processes end)."""
    key = f"shm/{layout.dp_rank}/{pp_rank}"
    if tp_rank == 0:
        path = shm_ring.ShmAllReduce.new_path()
        ring = shm_ring.ShmAllReduce(path, True, layout.tp_size, 0, timeout_s)
        store.set(key, path)
    else:
        ring = shm_ring.ShmAllReduce(store.get(key).decode(), False, layout.tp_size, tp_rank, timeout_s)
    dist.barrier(group=group)
    if tp_rank == 0:
        ring.unlink()
    return ring
