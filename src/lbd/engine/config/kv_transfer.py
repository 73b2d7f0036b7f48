"""``--kv-transfer-config``: vLLM's JSON keys for prefill/decode disaggregation, parsed and checked with the
standard library only (``args`` validates the flag with it; the supervisor and the router read roles from it).

Keys (vLLM's ``KVTransferConfig``): ``kv_connector`` (``LbdConnector``: KV blocks pulled over TCP through ZMQ,
``lbd.engine.kv_transfer``; ``NixlConnector``: READ through NIXL, the same checks on the ZMQ side channel,
``lbd.engine.kv_transfer.nixl``; needs the ``nixl`` package), ``kv_role`` (``kv_producer``: prefills and
serves its blocks; ``kv_consumer``: pulls blocks for its decodes; ``kv_both``), ``engine_id`` (a fresh id per
start when unset), ``kv_ip`` (where the block server binds: loopback by default; anything else needs the
cluster token, which then CURVE-secures the channel), ``kv_port`` (0 or unset: the OS picks; else offset by
the DP rank, as vLLM does) and ``kv_connector_extra_config``: ``pull_timeout_s`` (5: a consumer that has not
got its blocks by then recomputes the prefill itself), ``lease_s`` (60: a producer frees blocks nobody pulled
after this), ``max_pull_bytes`` (1 GiB: the largest answer a consumer reads), ``max_leases`` (256) and
``max_lease_bytes`` (unset: half this rank's KV cache): a producer holds at most so many leases and bytes
for pulls; a prefill beyond either still answers, with no blocks to pull (its decode recomputes), and the
refusal is counted (``lbd:kv_transfer_lease_refusals_total``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CONNECTORS = ("LbdConnector", "NixlConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
FLAG = "--kv-transfer-config"
EXAMPLE = '\'{"kv_connector": "LbdConnector", "kv_role": "kv_both"}\''
_KEYS = {"kv_connector", "kv_role", "engine_id", "kv_ip", "kv_port", "kv_connector_extra_config",
         "kv_rank", "kv_parallel_size", "kv_buffer_device", "kv_buffer_size"}  # the last four: vLLM's, unused
_EXTRA = {"pull_timeout_s": 5.0, "lease_s": 60.0, "max_pull_bytes": float(1 << 30), "max_leases": 256.0,
          "max_lease_bytes": 0.0}  # 0: half the rank's KV cache


@dataclass(slots=True, frozen=True)
class KVTransferConfig:
    kv_connector: str = "LbdConnector"
    kv_role: str = "kv_both"
    engine_id: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    pull_timeout_s: float = 5.0
    lease_s: float = 60.0
    max_pull_bytes: int = 1 << 30
    max_leases: int = 256  # leases a producer holds at once
    max_lease_bytes: int = 0  # bytes of blocks a producer holds for pulls (0: half its KV cache)

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def port_for(self, rank: int) -> int:
        """The block server's port for DP rank ``rank`` (0 stays 0: the OS picks)."""
        return self.kv_port + rank if self.kv_port else 0


def _loads(text: str) -> dict[str, Any]:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{FLAG} is not valid JSON ({e.msg} at column {e.colno}), e.g. {EXAMPLE}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{FLAG} must be a JSON object, e.g. {EXAMPLE}")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ValueError(f"{FLAG}: unknown key(s) {unknown}; known: {sorted(_KEYS)}")
    return raw


def _extra(raw: Any) -> dict[str, float]:
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{FLAG}: kv_connector_extra_config must be a JSON object")
    unknown = sorted(set(raw) - set(_EXTRA))
    if unknown:
        raise ValueError(f"{FLAG}: unknown kv_connector_extra_config key(s) {unknown}; "
                         f"known: {sorted(_EXTRA)}")
    out = dict(_EXTRA)
    for key, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{FLAG}: kv_connector_extra_config.{key} must be a positive number, "
                             f"got {value!r}")
        out[key] = float(value)
    return out


def parse_kv_transfer_config(text: str) -> KVTransferConfig:
    """The flag's JSON as a config; ValueError naming the key and the fix."""
    raw = _loads(text)
    connector = raw.get("kv_connector")
    if connector not in CONNECTORS:
        raise ValueError(f"{FLAG}: kv_connector {connector!r} is not one of {list(CONNECTORS)} "
                         "(LbdConnector moves KV blocks over TCP through ZMQ, NixlConnector through NIXL)")
    role = raw.get("kv_role")
    if role not in ROLES:
        raise ValueError(f"{FLAG}: kv_role {role!r} is not one of {list(ROLES)}")
    engine_id, ip, port = raw.get("engine_id"), raw.get("kv_ip", "127.0.0.1"), raw.get("kv_port", 0)
    if engine_id is not None and (not isinstance(engine_id, str) or not engine_id):
        raise ValueError(f"{FLAG}: engine_id must be a non-empty string")
    if not isinstance(ip, str) or not ip:
        raise ValueError(f"{FLAG}: kv_ip must be an address string, e.g. \"127.0.0.1\"")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ValueError(f"{FLAG}: kv_port must be a port number (0: the OS picks), got {port!r}")
    extra = _extra(raw.get("kv_connector_extra_config"))
    return KVTransferConfig(kv_connector=connector, kv_role=role, engine_id=engine_id, kv_ip=ip, kv_port=port,
                            pull_timeout_s=extra["pull_timeout_s"], lease_s=extra["lease_s"],
                            max_pull_bytes=int(extra["max_pull_bytes"]), max_leases=int(extra["max_leases"]),
                            max_lease_bytes=int(extra["max_lease_bytes"]))
