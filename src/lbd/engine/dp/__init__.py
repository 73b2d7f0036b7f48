"""The data-parallel group of an MoE model: its DP ranks share the expert layers.

Rooms, with one-way imports (each only imports those above it):
  ``messages``        the timing of the ranks' wire to the coordinator (its types: ``lbd.wire.dp_messages``)
  ``coordinator_http`` the coordinator's HTTP port: /status, /metrics, member failures, resizes
  ``coordinator``     the process beside rank 0: TCPStore host, rank reports, waves, generations, resizes
  ``group``           one generation's torch.distributed process group (gloo on CPU, NCCL on CUDA)
  ``expert_parallel`` which experts a member holds and how tokens reach them (dispatch / combine)
  ``elastic``         a member's experts re-placed for a new group size (a resize, in the same process)
  ``wave``            the wave bookkeeping of one rank (pure)
  ``rank``            the core loop of a rank in a group: waves, dummy passes, healing

A dense model never enters this package: its DP ranks are independent. This module stays light (no torch):
the rank's launcher (``lbd.engine.rank_core``) asks ``needs_group`` before anything heavy is imported (the
supervisor asks ``lbd.engine.config.architectures`` instead).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lbd.engine.config.architectures import is_moe

if TYPE_CHECKING:
    from lbd.engine.config.args import EngineArgs

# ports relative to --data-parallel-rpc-port P (P itself: lbd serve's multi-node registration)
STORE_PORT_OFFSET = 1
ZMQ_PORT_OFFSET = 2
HTTP_PORT_OFFSET = 3


def needs_group(args: EngineArgs, architectures: Any) -> bool:
    """Whether this rank joins a DP group: an MoE model served by more than one DP rank."""
    return args.data_parallel_size > 1 and is_moe(architectures)


def endpoints(args: EngineArgs) -> tuple[str, int, str]:
    """(store host, store port, coordinator ZMQ address) of a rank's group."""
    host, port = args.data_parallel_address, args.data_parallel_rpc_port
    if host is None or port is None:
        raise ValueError("an MoE DP group needs --data-parallel-address and --data-parallel-rpc-port")
    zmq_host = f"[{host}]" if ":" in host else host
    return host, port + STORE_PORT_OFFSET, f"tcp://{zmq_host}:{port + ZMQ_PORT_OFFSET}"
