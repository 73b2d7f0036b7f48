"""The DP group as the head knows it: which node runs which ranks, their last reported state, what is missing.

Pure bookkeeping (no I/O; the clock is passed in), used by the registration service (`lbd.serve.registry`)
and the head's health port. A node registers its rank range; the head checks it against the group (same
--data-parallel-size, same served models, inside 0..N-1, not overlapping the head's ranks or a live node's)
and refuses it with a message naming the flag otherwise. A registration is a lease: each heartbeat (which
carries the node's ranks as its supervisor reports them) renews it; a node whose lease ran out is *lost*: its
ranks stay listed, not routable, until it comes back (same node id: no restart needed) or another node takes
its range over.

Identity: a registration binds the node's ranks and its health URL to its node id. While the lease is live no
other node id may register them (409, param ``node_id``: a restarted node waits for its old lease to lapse,
then takes its ranks back); once it lapsed, another registrant may take the range over, and on a head that
listens beyond loopback only a holder of the cluster token can register at all (the registry answers 401
otherwise). So nobody without the token can point the router at rank URLs of their choosing.

Rendezvous for the DP group's collective layers (MoE across DP ranks): the registration service owns
``--data-parallel-rpc-port`` P on the head's ``--data-parallel-address`` A; P+1 is the torch.distributed
TCPStore of the group, P+2 the DP coordinator's port beside rank 0 and P+3 its HTTP port (the coordinator
binds all three; every node's supervisor passes A and P to its ranks). The head advertises them in every
registration reply and in GET /v1/group (``rendezvous``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from msgspec.structs import replace

from lbd.wire.registration import NodeRegistration
from lbd.wire.states import RankState
from lbd.wire.status import (
    GroupView,
    NodeInfo,
    RankStatus,
    RegistryRendezvous,
    Rejection,
)

STORE_OFFSET, COORDINATOR_OFFSET, COORDINATOR_HTTP_OFFSET = 1, 2, 3
MAX_REJECTIONS_KEPT = 10


def rendezvous(address: str | None, rpc_port: int) -> RegistryRendezvous:
    """Where the group's collective layers meet (see the module docstring)."""
    return RegistryRendezvous(address=address, registry_port=rpc_port, store_port=rpc_port + STORE_OFFSET,
                              coordinator_port=rpc_port + COORDINATOR_OFFSET,
                              coordinator_http_port=rpc_port + COORDINATOR_HTTP_OFFSET)


def span(ranks: list[int]) -> str:
    """"2-3, 5" for [2, 3, 5]."""
    out: list[str] = []
    for r in sorted(ranks):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


class Rejected(Exception):
    """A registration the group cannot take: HTTP status, the message, and the flag it is about."""

    def __init__(self, message: str, param: str | None = None, status: int = 409) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


@dataclass(slots=True)
class Member:
    node_id: str
    address: str
    start: int
    count: int
    health_url: str | None
    models: list[str]
    ranks: list[RankStatus]  # the node's last reported rank entries (URLs reachable from the head)
    registered_at: float
    last_seen: float
    lost: bool = False
    hostname: str = ""

    @property
    def rank_ids(self) -> range:
        return range(self.start, self.start + self.count)

    def describe(self, now: float) -> NodeInfo:
        return NodeInfo(node_id=self.node_id, address=self.address, hostname=self.hostname,
                        health_url=self.health_url, ranks=list(self.rank_ids),
                        state="lost" if self.lost else "registered",
                        last_heartbeat_s_ago=round(now - self.last_seen, 3), models=self.models)


@dataclass(slots=True)
class Group:
    dp_size: int
    models: list[str]
    head_ranks: range  # the head's own ranks (empty on a router-only head)
    lease_s: float
    members: dict[str, Member] = field(default_factory=dict)
    rejected: list[Rejection] = field(default_factory=list)

    # ---- registrations ------------------------------------------------------------------------------
    def register(self, reg: NodeRegistration, now: float, wall: float) -> Member:
        """Admit (or re-admit) a node; raises Rejected with the reason."""
        start, count = reg.data_parallel_start_rank, reg.data_parallel_size_local
        try:
            self._check(reg.node_id, reg.address, str(reg.health_url), reg.data_parallel_size, start, count,
                        reg.models, now)
        except Rejected as e:
            refused = Rejection(at=wall, address=reg.address, ranks=span(list(range(start, start + count))),
                                reason=e.message)
            self.rejected = [*self.rejected, refused][-MAX_REJECTIONS_KEPT:]
            raise
        taken = set(range(start, start + count))
        for other in [m for m in self.members.values()
                      if set(m.rank_ids) & taken
                      or (m.health_url is not None and m.health_url == reg.health_url)]:
            del self.members[other.node_id]  # itself, or a lapsed lease: this registration takes over
        member = Member(reg.node_id, reg.address, start, count, reg.health_url, list(reg.models),
                        list(reg.ranks), now, now, hostname=reg.hostname)
        self.members[reg.node_id] = member
        return member

    def _check(self, node_id: str, address: str, health_url: str, size: int, start: int, count: int,
               models: list[str], now: float) -> None:
        if size != self.dp_size:
            raise Rejected(f"node {address} has --data-parallel-size {size} but the head's group has "
                           f"{self.dp_size}: start every node with the same --data-parallel-size",
                           "data_parallel_size")
        ranks = set(range(start, start + count))
        if count <= 0 or start < 0 or start + count > self.dp_size:
            raise Rejected(f"node {address} asks for ranks {start}..{start + count - 1}, outside the group's "
                           f"0..{self.dp_size - 1}: fix --data-parallel-start-rank / "
                           "--data-parallel-size-local",
                           "data_parallel_start_rank")
        if models and self.models and sorted(models) != sorted(self.models):
            raise Rejected(f"node {address} serves {models} but the head serves {self.models}: start every "
                           "node with the same --model / --served-model-name", "model")
        mine = ranks & set(self.head_ranks)
        if mine:
            raise Rejected(f"ranks {span(sorted(mine))} are the head's own (it runs ranks "
                           f"{span(list(self.head_ranks))}): start node {address} with another "
                           "--data-parallel-start-rank", "data_parallel_start_rank")
        self.expire(now)
        for other in self.members.values():
            if other.node_id == node_id or other.lost:
                continue  # the node itself registering again, or a lapsed lease: the range is free
            if other.health_url == health_url:
                raise Rejected(f"health URL {health_url} is registered by another node id (heartbeat "
                               f"{now - other.last_seen:.1f} s ago): a restarted node is admitted once that "
                               f"lease lapses ({self.lease_s:.1f} s without heartbeats)", "node_id")
            clash = ranks & set(other.rank_ids)
            if clash:
                raise Rejected(f"ranks {span(sorted(clash))} are already registered by node {other.address} "
                               f"(heartbeat {now - other.last_seen:.1f} s ago): start node {address} with "
                               "another --data-parallel-start-rank", "data_parallel_start_rank")

    def heartbeat(self, node_id: str, ranks: list[RankStatus], now: float) -> Member | None:
        """Renew a lease with the node's current ranks; None: not registered (any more): register again."""
        member = self.members.get(node_id)
        if member is None:
            return None
        member.ranks, member.last_seen, member.lost = ranks, now, False
        return member

    def leave(self, node_id: str) -> bool:
        return self.members.pop(node_id, None) is not None

    def expire(self, now: float) -> None:
        for m in self.members.values():
            m.lost = now - m.last_seen > self.lease_s

    # ---- views ------------------------------------------------------------------------------------------
    def ranks(self, head_entries: list[RankStatus], now: float) -> list[RankStatus]:
        """Every rank 0..N-1 in /status form: the head's, the members' (lost ones not routable), and a
        placeholder (state ``missing``, no URL) for each rank no node has registered."""
        self.expire(now)
        by_rank = {e.rank: e for e in head_entries if e.rank is not None}
        for m in self.members.values():
            reported = {e.rank: e for e in m.ranks if e.rank is not None}
            for r in m.rank_ids:
                e = replace(reported.get(r) or RankStatus(rank=r, state=RankState.STARTING, routable=False),
                            node=m.address)
                if m.lost:
                    silent = now - m.last_seen
                    e = replace(e, state=RankState.UNREACHABLE, routable=False,
                                last_probe_error=f"node {m.address} sent no heartbeat for {silent:.1f} s")
                by_rank[r] = e
        for r in self.missing(now):
            by_rank[r] = RankStatus(rank=r, state=RankState.MISSING, routable=False,
                                    last_probe_error="no node has registered this rank")
        return [by_rank[r] for r in sorted(by_rank)]

    def missing(self, now: float) -> list[int]:
        have = set(self.head_ranks)
        for m in self.members.values():
            have |= set(m.rank_ids)
        return [r for r in range(self.dp_size) if r not in have]

    def describe(self, now: float) -> GroupView:
        self.expire(now)
        nodes = [m.describe(now) for m in sorted(self.members.values(), key=lambda m: m.start)]
        return GroupView(data_parallel_size=self.dp_size, lease_s=self.lease_s, models=self.models,
                         head_ranks=list(self.head_ranks), nodes=nodes, missing_ranks=self.missing(now),
                         rejected=list(self.rejected))
