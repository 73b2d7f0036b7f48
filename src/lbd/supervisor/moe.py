"""Is ``--model`` a mixture-of-experts model? Read from its config.json as JSON (no torch, no transformers).

MoE ranks are not independent (their expert layers span every rank of the DP group), so the supervisor forms
an MoE group of them (``lbd.supervisor.group``); dense ranks stay independent servers. A model is MoE when its
config.json (or its ``text_config``) declares a positive expert count under one of the keys transformers'
MoE configs use, or names an MoE architecture whose class defaults to experts when the key is omitted.

A GGUF file that was never converted has no config.json to read yet: it is treated as dense (the loader reads
MoE models from HF folders only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lbd.common.cluster import CLUSTER_TOKEN_ENV, NO_TOKEN_FIX, is_loopback
from lbd.common.ports import port_in_use

if TYPE_CHECKING:
    from lbd.wire.status import GroupRendezvous

EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
# transformers' defaults of the expert count where config.json may omit it
MOE_ARCHITECTURE_DEFAULTS = {"MixtralForCausalLM": 8, "Qwen3MoeForCausalLM": 128, "Qwen2MoeForCausalLM": 60,
                             "DeepseekV2ForCausalLM": 64, "DeepseekV3ForCausalLM": 256}


@dataclass(frozen=True, slots=True)
class MoeFacts:
    architecture: str
    num_experts: int

    def describe(self) -> str:
        return f"{self.architecture} with {self.num_experts} experts"


def config_json(model: str | None) -> dict[str, Any] | None:
    """config.json of ``--model`` (an HF folder, or a GGUF's converted copy in the cache), or None."""
    from lbd.engine.config.parallel import config_path

    try:
        config = config_path(model)
        raw = json.loads(config.read_text()) if config is not None else None
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def moe_facts_of(raw: dict[str, Any]) -> MoeFacts | None:
    archs = [str(a) for a in raw.get("architectures") or []]
    arch = archs[0] if archs else str(raw.get("model_type") or "(no architecture)")
    for section in (raw, raw.get("text_config") or {}):
        for key in EXPERT_COUNT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return MoeFacts(arch, value) if value > 0 else None
    default = next((MOE_ARCHITECTURE_DEFAULTS[a] for a in archs if a in MOE_ARCHITECTURE_DEFAULTS), None)
    return MoeFacts(arch, default) if default else None


def moe_facts(model: str | None) -> MoeFacts | None:
    """The model's MoE facts, or None for a dense model (or one whose config.json cannot be read)."""
    raw = config_json(model)
    return moe_facts_of(raw) if raw is not None else None


# ---- the group this node's ranks belong to -----------------------------------------------------------------
STORE_OFFSET, ZMQ_OFFSET, HTTP_OFFSET = 1, 2, 3  # from --data-parallel-rpc-port P (lbd.engine.dp's layout)
DEFAULT_RPC_PORT = 29550  # vLLM's --data-parallel-rpc-port default, for groups spanning nodes
LOOPBACK = "127.0.0.1"
RESTART_GROUP, RESTART_RANK, EXIT = "restart-group", "restart-rank", "exit"


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """The MoE group of the DP ranks: where it meets, whether this node runs its coordinator."""

    moe: MoeFacts
    size: int  # --data-parallel-size: members in the whole group
    local_ranks: tuple[int, ...]  # the members this supervisor runs
    address: str  # --data-parallel-address: rank 0's node
    rpc_port: int  # --data-parallel-rpc-port P: store P+1, coordinator ZMQ P+2, its HTTP P+3
    expert_parallel: bool
    runs_coordinator: bool  # this node runs rank 0, so the coordinator beside it
    # the cluster token (lbd.common.cluster): the coordinator and the ranks get it in their environment
    token: str | None = field(default=None, repr=False)
    insecure: bool = False  # --insecure-cluster: a group beyond loopback without a token

    def child_env(self) -> dict[str, str]:
        """What the coordinator and the members get in their environment (never on a command line)."""
        return {CLUSTER_TOKEN_ENV: self.token} if self.token else {}

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    @property
    def coordinator_url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.rpc_port + HTTP_OFFSET}"

    def rendezvous(self) -> GroupRendezvous:
        from lbd.wire.status import GroupRendezvous  # lazily, for cold start (lbd.wire.states)

        return GroupRendezvous(address=self.address, rpc_port=self.rpc_port,
                               store_port=self.rpc_port + STORE_OFFSET,
                               coordinator_port=self.rpc_port + ZMQ_OFFSET,
                               coordinator_http_port=self.rpc_port + HTTP_OFFSET)

    def rank_flags(self) -> list[str]:
        """What every member gets on top of the passed-through engine flags."""
        return ["--data-parallel-address", self.address, "--data-parallel-rpc-port", str(self.rpc_port)]

    def coordinator_argv(self, python: str, log_level: str) -> list[str]:
        return [python, "-m", "lbd.engine.dp.coordinator", "--data-parallel-size", str(self.size),
                "--data-parallel-address", self.address, "--data-parallel-rpc-port", str(self.rpc_port),
                "--log-level", log_level, *(["--insecure-cluster"] if self.insecure else [])]


def free_rpc_port(host: str = LOOPBACK, tries: int = 50) -> int:
    """A port P from the OS such that P+1..P+3 (the group's store, coordinator and its HTTP) are free now."""
    import socket

    for _ in range(tries):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            first = s.getsockname()[1]
        base = first - STORE_OFFSET
        if base < 1 or first + HTTP_OFFSET - STORE_OFFSET > 65535:
            continue
        held: list[socket.socket] = []
        try:
            for port in range(first, base + HTTP_OFFSET + 1):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(sock)
                sock.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise OSError(f"no free run of {HTTP_OFFSET} ports found on {host}")


def engine_moe_architectures() -> frozenset[str] | None:
    """The architectures the engine serves as MoE groups (None if this engine does not say)."""
    from lbd.engine.config import architectures

    names = getattr(architectures, "MOE_ARCHITECTURES", None)
    return frozenset(names) if names is not None else None


def model_moe(model: str | None, device: str) -> MoeFacts | None:
    """MoE facts when the engine will run ``model``'s ranks as one group."""
    if device == "sim":
        return None
    facts = moe_facts(model)
    known = engine_moe_architectures()
    if facts is not None and known is not None and facts.architecture not in known:
        return None  # an MoE the engine does not serve as such (it refuses the model itself)
    return facts


class GroupFlagError(ValueError):
    """A group flag that cannot work with this model or topology (one line; lbd supervise exits 2)."""


def _check_coordinator_ports(ns: Any, local: int, address: str, port: int) -> None:
    """The coordinator's three ports above P are free and none is a rank's or the health port."""
    taken = {p: f"rank port of local rank {p - ns.port}" for p in range(ns.port, ns.port + local)}
    taken[ns.data_parallel_supervisor_port] = "--data-parallel-supervisor-port"
    for offset, role in ((STORE_OFFSET, "store"), (ZMQ_OFFSET, "coordinator"),
                         (HTTP_OFFSET, "coordinator's HTTP")):
        if port + offset in taken:
            raise GroupFlagError(f"--data-parallel-rpc-port {port}: the group's {role} port "
                                 f"{port + offset} is the {taken[port + offset]}: move one of them")
        problem = port_in_use(address, port + offset)
        if problem:
            raise GroupFlagError(f"--data-parallel-rpc-port {port}: the group's {role} {problem}: pick "
                                 "another --data-parallel-rpc-port (it uses the 3 ports above it)")


def plan_group(ns: Any, n: int, local: int, start: int,
               token: str | None = None) -> tuple[GroupSpec | None, str]:
    """The MoE group of this node's ranks (None: independent dense ranks) and the --on-rank-failure policy
    that applies; raises GroupFlagError for a combination that means nothing, or for a group that meets
    beyond loopback without the cluster token (``token``) or --insecure-cluster."""
    moe = model_moe(ns.model, ns.device)
    grouped = moe is not None and n > 1
    policy = ns.on_rank_failure
    if policy in (None, "restart"):  # the model's default
        policy = RESTART_GROUP if grouped else RESTART_RANK
    if not grouped:
        why = (f"{moe.describe()} served by one DP rank has no group" if moe is not None
               else "the model is dense: its DP ranks are independent servers with no group")
        for flag, given in (("--data-parallel-address", ns.data_parallel_address is not None),
                            ("--data-parallel-rpc-port", ns.data_parallel_rpc_port is not None),
                            ("--on-rank-failure restart-group", policy == RESTART_GROUP),
                            ("--enable-expert-parallel", ns.enable_expert_parallel and moe is None)):
            if given:
                fix = "use restart-rank (the default)" if flag.endswith("restart-group") else "drop it"
                raise GroupFlagError(f"{flag} applies to the DP group of an MoE model, but {why}: {fix}")
        return None, policy
    assert moe is not None
    what = f"{moe.describe()} with --data-parallel-size {n}"
    if policy == RESTART_RANK:
        raise GroupFlagError(f"--on-rank-failure restart-rank keeps the other ranks serving alone, but the "
                             f"ranks of {what} form one group (their expert layers span every rank): use "
                             "restart-group (the default: only the failed rank restarts, the others re-join) "
                             "or exit")
    if ns.ready_policy != "all":
        raise GroupFlagError(f"--ready-policy {ns.ready_policy}: {what} serves only when every member is up "
                             "(the group is ready or not): drop --ready-policy")
    if ns.data_parallel_backend != "mp":
        raise GroupFlagError(f"--data-parallel-backend {ns.data_parallel_backend} does not run MoE groups "
                             f"yet ({what}): use mp, one lbd supervise per node")
    spans_nodes = local < n
    address = ns.data_parallel_address
    if address is None:
        if spans_nodes:
            raise GroupFlagError(f"{what} spans nodes (--data-parallel-size-local {local}): every node "
                                 "meets at rank 0's node: pass --data-parallel-address <rank 0's node "
                                 f"address> (and --data-parallel-rpc-port, default {DEFAULT_RPC_PORT})")
        address = LOOPBACK
    port = ns.data_parallel_rpc_port
    if port is None:
        port = DEFAULT_RPC_PORT if spans_nodes or ns.data_parallel_address is not None else free_rpc_port()
    if not 0 < port <= 65535 - HTTP_OFFSET:
        raise GroupFlagError(f"--data-parallel-rpc-port {port} is out of range: the group uses it and the "
                             f"{HTTP_OFFSET} ports above it, so use 1..{65535 - HTTP_OFFSET}")
    insecure = bool(getattr(ns, "insecure_cluster", False))
    if not is_loopback(address) and token is None and not insecure:
        raise GroupFlagError(f"{what} meets at --data-parallel-address {address}, beyond loopback: its "
                             "store, coordinator and collectives would be open to anyone there: "
                             f"{NO_TOKEN_FIX}")
    runs_coordinator = start == 0
    if runs_coordinator:
        _check_coordinator_ports(ns, local, address, port)
    spec = GroupSpec(moe=moe, size=n, local_ranks=tuple(range(start, start + local)), address=address,
                     rpc_port=port, expert_parallel=bool(ns.enable_expert_parallel),
                     runs_coordinator=runs_coordinator, token=token, insecure=insecure)
    return spec, policy
