"""/status, as the supervisor (``lbd supervise``'s health port), ``lbd serve``'s health port and the engine
answer it; routers, ``lbd serve`` and operators read it. The JSON field names are the wire's (supervisor/
health.py documents each); encode with ``encode``, read with ``decode_supervisor_status``; the states are
in ``lbd.wire.states``.

Every field has a default, so a peer that sends fewer (an older supervisor, a stand-in) still decodes;
fields this version does not know are skipped, and a state it does not know reads ``unknown``. Fields
typed ``... | UnsetType`` appear only where they apply (``group`` of an MoE member, ``node`` of a rank another
node reported, ``supervisor_pid`` and ``deployment`` of ``lbd serve``).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType, field

from lbd.wire.codec import json_decoder
from lbd.wire.dp import DPState, DPStatus, Wave
from lbd.wire.roles import NodeRole, RankRole
from lbd.wire.scale import ScaleResult
from lbd.wire.states import NodePhase, RankState, RollingState


class WorkerProcess(msgspec.Struct):
    """One TP/PP worker process of a rank."""

    pid: int
    rank: int
    tp_rank: int
    pp_rank: int
    cpus: str | None = None


class RankStatus(msgspec.Struct):
    """One rank's entry in ``ranks``. ``routable`` left out by a peer reads as ``state == ready``."""

    rank: int | None = None  # global DP rank (what X-data-parallel-rank names)
    local_rank: int | None = None
    url: str = ""  # the engine's base URL
    port: int | None = None
    pid: int | None = None  # the rank's launcher pid (null while it is down)
    state: RankState = RankState.UNKNOWN
    routable: bool | None = None  # routers send new requests only to routable ranks
    state_since: float | None = None
    consecutive_failures: int = 0
    restarts: int = 0
    last_probe_latency_s: float | None = None
    last_probe_at: float | None = None
    last_probe_error: str | None = None
    uptime_s: float | None = None
    ready_for_s: float | None = None
    last_failure: str | None = None
    last_failure_at: float | None = None
    last_exit_code: int | None = None
    next_start_in_s: float | None = None
    operation: str | None = None  # the admin command being carried out: drain | restart
    group_wait: str | None = None  # an MoE member alive but waiting for its group: why
    devices: str | None = None
    cpus: str | None = None
    engine: str | None = None  # lbd | vllm | sglang | command
    workers: list[WorkerProcess] = field(default_factory=list)
    attempts: int = 0
    backoff_s: float | None = None
    stderr_tail: list[str] = field(default_factory=list)
    error_lines: list[str] = field(default_factory=list)  # the engine's logged errors and exceptions
    command: list[str] = field(default_factory=list)
    kv_event_sources: dict[str, Any] | None = None  # vLLM's /kv_event_sources shape
    group: int | UnsetType = UNSET  # MoE members: the index of its entry in ``groups``
    node: str | UnsetType = UNSET  # lbd serve's head: the address of the node that reported it
    role: RankRole = RankRole.MIXED  # prefill/decode disaggregation (lbd supervise --prefill-ranks ...)

    def __post_init__(self) -> None:
        if self.routable is None:
            self.routable = self.state is RankState.READY


class ProbeSettings(msgspec.Struct):
    interval_s: float
    timeout_s: float
    failure_threshold: int
    generate_every: int


class RollingRestart(msgspec.Struct):
    """The last rolling restart (mutable: the node updates it as it goes)."""

    state: RollingState = RollingState.RUNNING
    started_at: float | None = None
    finished_at: float | None = None
    current_rank: int | None = None
    done_ranks: list[int] = field(default_factory=list)
    error: str | None = None


class GroupMember(msgspec.Struct):
    """A member of an MoE group: the supervisor's view (local ones) and the coordinator's."""

    rank: int
    local: bool = False
    state: RankState | None = None  # null: it runs on another node
    pid: int | None = None
    group_wait: str | None = None
    core_pid: int | None = None  # as the coordinator heard, like the rest
    joined: bool | None = None
    waiting: int | None = None
    running: int | None = None
    last_report_age_s: float | None = None
    wave_active: bool | None = None


class GroupRendezvous(msgspec.Struct):
    address: str | None = None
    rpc_port: int | None = None
    store_port: int | None = None
    coordinator_port: int | None = None
    coordinator_http_port: int | None = None


class CoordinatorInfo(msgspec.Struct):
    """The group's DP coordinator as this node sees it."""

    url: str = ""
    local: bool = False  # this node runs it
    pid: int | None = None
    alive: bool | None = None  # null: it runs on another node
    restarts: int = 0
    last_exit_code: int | None = None
    status_age_s: float | None = None
    error: str | None = None


class Recovery(msgspec.Struct):
    """A failed member not yet back."""

    rank: int
    why: str = ""
    failed_at: float | None = None
    generation: int | None = None  # in service when it failed
    for_s: float | None = None


class LastRecovery(Recovery):
    ready_after_s: float | None = None
    ranks: list[int] = field(default_factory=list)
    ready_generation: int | None = None


class GroupStatus(msgspec.Struct):
    """An MoE group's entry in ``groups``."""

    group: int = 0
    kind: str = "moe"
    model: str | None = None
    num_experts: int | None = None
    size: int = 0
    local_ranks: list[int] = field(default_factory=list)
    expert_parallel: bool = False
    on_rank_failure: str | None = None
    ready: bool = False
    reason: str = ""
    generation: int | None = None  # the coordinator's
    state: DPState | None = None  # the coordinator's (null: it does not answer)
    wave: Wave | None = None
    generation_aborts: int | None = None
    rendezvous: GroupRendezvous = field(default_factory=GroupRendezvous)
    coordinator: CoordinatorInfo = field(default_factory=CoordinatorInfo)
    members: list[GroupMember] = field(default_factory=list)
    recovering: list[Recovery] = field(default_factory=list)
    recoveries: int = 0
    last_recovery: LastRecovery | None = None


class RegistryRendezvous(msgspec.Struct):
    """Where an ``lbd serve`` group meets: the head's registration port P, the store P+1, the coordinator
    P+2 and its HTTP port P+3 (the head sends it in every registration answer too)."""

    address: str | None = None
    registry_port: int | None = None
    store_port: int | None = None
    coordinator_port: int | None = None
    coordinator_http_port: int | None = None


class NodeInfo(msgspec.Struct):
    """A node registered with the head."""

    node_id: str
    address: str = ""
    hostname: str = ""
    health_url: str | None = None
    ranks: list[int] = field(default_factory=list)
    state: str = "registered"  # registered | lost (its lease ran out)
    last_heartbeat_s_ago: float | None = None
    models: list[str] = field(default_factory=list)


class Rejection(msgspec.Struct):
    """A registration the head refused (the last few are kept)."""

    at: float
    address: str
    ranks: str  # e.g. "2-3"
    reason: str


class GroupView(msgspec.Struct):
    """The DP group as the head knows it (``deployment.group``, and GET /v1/group with ``rendezvous``)."""

    data_parallel_size: int = 0
    lease_s: float = 0.0
    models: list[str] = field(default_factory=list)
    head_ranks: list[int] = field(default_factory=list)
    nodes: list[NodeInfo] = field(default_factory=list)
    missing_ranks: list[int] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    rendezvous: RegistryRendezvous | UnsetType = UNSET


class Registration(msgspec.Struct):
    """A member node's registration with the head."""

    state: str = "connecting"  # connecting | registered | disconnected | rejected
    reason: str = ""
    since: float | None = None
    head: str = ""
    node_id: str = ""
    attempts: int = 0
    advertise_address: str | None = None
    rendezvous: RegistryRendezvous | None = None  # from the head's answer


class RouterInfo(msgspec.Struct):
    port: int | None = None
    workers: int = 1
    alive: bool = False


class AutoscaleState(msgspec.Struct):
    """``deployment.autoscale`` of ``lbd serve --autoscale MIN:MAX``: the built-in planner
    (lbd.serve.autoscale): its bounds and delays, the last signals it read from its router and the rule's
    recommendation, how long the recommendation has stayed above (below) the size, its last decision."""

    min_ranks: int = 0
    max_ranks: int = 0
    interval_s: float = 0.0
    up_after_s: float = 0.0
    down_after_s: float = 0.0
    cooldown_s: float = 0.0
    recommended_ranks: int | None = None
    above_for_s: float | None = None
    below_for_s: float | None = None
    cooling: bool = False
    decisions: int = 0
    last_decision: str | None = None
    error: str | None = None  # the last read or resize that failed
    ranks: int | None = None  # the signals (lbd.common.scaling.Signals)
    saturation: float | None = None
    token_backlog: int | None = None
    predicted_ttft_s: float | None = None  # null: no rank serves and work waits
    ttft_target_s: float | None = None


class Deployment(msgspec.Struct):
    """``deployment`` in an ``lbd serve`` node's /status: its role, and the group (head) or its registration
    (member), and its router child."""

    role: NodeRole = NodeRole.UNKNOWN
    load_balancing: str = "internal"  # internal | hybrid
    data_parallel_size: int = 0
    data_parallel_size_local: int = 0
    data_parallel_start_rank: int = 0
    address: str | None = None
    rpc_port: int | None = None
    registry: bool = False
    group: GroupView | UnsetType = UNSET
    rendezvous: RegistryRendezvous | UnsetType = UNSET
    registration: Registration | UnsetType = UNSET
    router: RouterInfo | UnsetType = UNSET
    autoscale: AutoscaleState | UnsetType = UNSET  # lbd serve --autoscale


class SupervisorStatus(msgspec.Struct):
    """GET /status of a supervisor, or of an ``lbd serve`` node (same shape, plus its deployment)."""

    ready: bool = False  # /readyz's answer
    live: bool = True  # /health's answer
    reason: str = ""
    phase: NodePhase = NodePhase.RUNNING
    pid: int | None = None
    node_rank: int | None = None
    data_parallel_size: int = 0
    data_parallel_size_local: int = 0
    data_parallel_start_rank: int = 0
    ready_policy: str = ""
    ready_ranks: int = 0
    on_rank_failure: str | None = None
    probe: ProbeSettings | None = None
    uptime_s: float = 0.0
    rolling_restart: RollingRestart | None = None
    scaling: ScaleResult | None = None  # the last resize (POST /scale, lbd.wire.scale), null before any
    ranks: list[RankStatus] = field(default_factory=list)
    groups: list[GroupStatus] = field(default_factory=list)
    supervisor_pid: int | None | UnsetType = UNSET  # lbd serve: its supervisor child's pid
    deployment: Deployment | UnsetType = UNSET  # lbd serve: role, group or registration, router


class EngineStatus(msgspec.Struct):
    """GET /status of an engine rank (lbd's own): ``dp`` is its MoE DP group's status, null when none."""

    rank: int | None = None
    pid: int | None = None
    core_pid: int | None = None
    ready: bool = False
    dp: DPStatus | None = None




def encode(status: msgspec.Struct) -> bytes:
    """JSON of any /status type here."""
    return msgspec.json.encode(status)


def decode_supervisor_status(body: bytes) -> SupervisorStatus:
    """Raises ValueError (msgspec's errors are ValueErrors) when ``body`` is not a supervisor status."""
    return json_decoder(SupervisorStatus).decode(body)


def decode_engine_status(body: bytes) -> EngineStatus:
    return json_decoder(EngineStatus).decode(body)
