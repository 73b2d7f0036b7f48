"""One generation of a DP group: a torch.distributed process group over the ranks' core processes.

The TCPStore is hosted by the coordinator (``A:P+1``), so it outlives any rank; each generation ``g`` uses
the store under the prefix ``lbd-dp/g/``, so a group re-forms on the same store after a member dies. The
process group is made directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), not as torch's default group:
a generation is one object, dropped when it breaks, and nothing global is left behind for the next one.

Where it listens, and what protects it: the store binds ``--data-parallel-address`` only (torch's own server
would take every interface; the socket is bound here and handed over), so a group on one machine meets on
loopback and nothing off the machine reaches it; the members' gloo/NCCL sockets then stay on the loopback
interface too. A group that spans machines must expose the store on the cluster address, and torch's TCPStore
has no authentication (a client can list, read and overwrite keys): a key prefix derived from the token would
hide nothing from a client that lists keys, so none is claimed. What guards such a group: the cluster token is
required to start it (lbd supervise / lbd serve refuse a multi-machine group without ``LBD_CLUSTER_TOKEN`` or
``--cluster-token-file`` unless ``--insecure-cluster``), the coordinator's ZMQ channel (CURVE) and HTTP port
(bearer) verify it, so no outsider can join a generation, start or end waves or abort one, and the store and
the collective sockets must sit on a private network (firewall ``P+1`` and gloo's/NCCL's ports to the group's
machines): README, "Cluster wires".

Every collective waits at most ``--distributed-timeout-s``; any failure (gloo raises at once when a peer's
connection closes, e.g. the peer was killed) becomes ``GroupLost``, which the rank's loop turns into healing.
"""

from __future__ import annotations

import logging
import os
import re
from datetime import timedelta

import torch
import torch.distributed as dist

from lbd.common.cluster import LOOPBACK, is_loopback, listen_socket, loopback_interface

logger = logging.getLogger(__name__)


class GroupLost(RuntimeError):
    """A collective or the rendezvous of the DP group failed: the generation is over for this rank."""


def store_client(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def host_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The coordinator's store server, on ``host:port`` only."""
    sock = listen_socket(host, port)
    fd = sock.detach()  # the store owns the descriptor from here on
    try:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s), master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def _gloo_options(store: dist.Store, timeout: timedelta) -> dist.ProcessGroupGloo._Options | timedelta:
    """On a loopback store every member is on this machine: gloo's pair sockets listen on loopback too."""
    host = getattr(store, "host", None)
    if not is_loopback(host):
        return timeout
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    return opts


class DPGroup:
    """Rank ``rank`` of ``size`` in generation ``generation``; collectives in place or into given outputs."""

    def __init__(self, store: dist.Store, rank: int, size: int, generation: int, device: torch.device,
                 timeout_s: float) -> None:
        self.rank, self.size, self.generation, self.device = rank, size, generation, device
        prefixed = dist.PrefixStore(f"lbd-dp/{generation}/", store)
        timeout = timedelta(seconds=timeout_s)
        try:
            if device.type == "cuda":
                if is_loopback(getattr(store, "host", None)):  # NCCL's bootstrap on loopback too
                    os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback_interface())
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self.pg = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
            else:
                self.pg = dist.ProcessGroupGloo(prefixed, rank, size, _gloo_options(store, timeout))
        except Exception as e:  # the rendezvous timed out or a peer went away while it ran
            raise GroupLost(f"forming generation {generation} failed: {e}") from e
        self.broken: str | None = None

    def _wait(self, work: dist.Work, what: str) -> None:
        if self.broken:
            raise GroupLost(self.broken)
        try:
            work.wait()
        except Exception as e:
            self.broken = f"{what} of generation {self.generation} failed: {_first_line(e)}"
            raise GroupLost(self.broken) from e

    def _run(self, what: str, start) -> None:  # noqa: ANN001 (a thunk returning a Work)
        if self.broken:
            raise GroupLost(self.broken)
        try:
            work = start()
        except Exception as e:
            self.broken = f"{what} of generation {self.generation} failed: {_first_line(e)}"
            raise GroupLost(self.broken) from e
        self._wait(work, what)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place."""
        self._run("all-reduce", lambda: self.pg.allreduce([x]))
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every member's ``x`` (same shape everywhere), in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._run("all-gather", lambda: self.pg.allgather([parts], [x.contiguous()]))
        return parts

    def all_gather_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out`` [size * n, ...] = every member's ``x`` [n, ...] stacked in rank order."""
        parts = list(_split_rows(out, self.size))
        self._run("all-gather", lambda: self.pg.allgather([parts], [x.contiguous()]))
        return out

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out`` [n, ...] = the sum over members of their ``x`` [size * n, ...]'s ``rank``-th chunk."""
        chunks = list(_split_rows(x.contiguous(), self.size))
        self._run("reduce-scatter",
                  lambda: self.pg.reduce_scatter([out], [chunks], dist.ReduceScatterOptions()))
        return out

    def all_to_all(self, out: torch.Tensor, x: torch.Tensor, out_splits: list[int],
                   in_splits: list[int]) -> torch.Tensor:
        """Rows ``in_splits[d]`` of ``x`` go to member d; ``out`` receives ``out_splits[s]`` rows from s."""
        self._run("all-to-all", lambda: self.pg.alltoall_base(out, x.contiguous(), out_splits, in_splits,
                                                               dist.AllToAllOptions()))
        return out

    def close(self) -> None:
        """Drop the process group (NCCL: abort its communicators first, so nothing waits on a dead peer)."""
        pg, self.pg = getattr(self, "pg", None), None
        self.broken = self.broken or "closed"
        if pg is not None and self.device.type == "cuda":
            abort = getattr(pg, "abort", None)
            if abort is not None:
                try:
                    abort()
                except Exception as e:  # best effort: the communicator may be gone already
                    logger.warning("aborting the NCCL group failed: %s", e)


def _split_rows(x: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
    """``parts`` contiguous row blocks of a contiguous ``x`` (views; zero rows allowed)."""
    return x.view(parts, x.shape[0] // parts, *x.shape[1:]).unbind(0)


def _first_line(e: BaseException) -> str:
    """gloo's message without its source location and boilerplate advice."""
    text = str(e).strip().splitlines()
    line = re.sub(r"\[[^\]]*\.cc:\d+\] ", "", text[0] if text else type(e).__name__)
    return line.split(". This is typically")[0][:200]
