"""A node's registration with an ``lbd serve`` head (POST /v1/nodes, heartbeats PUT /v1/nodes/{id}) and the
head's answer. The node sends who it is, which ranks it runs and their state; the head answers with the
lease it grants and where the group meets. Unknown fields are skipped both ways."""

from __future__ import annotations

import msgspec

from lbd.wire.codec import json_decoder
from lbd.wire.status import RankStatus, RegistryRendezvous


class NodeRegistration(msgspec.Struct, kw_only=True):
    """What a node sends on registration and on every heartbeat."""

    node_id: str  # made at the node's start; binds the node's ranks to this registration
    address: str  # where the head reaches the node's ranks
    data_parallel_size: int
    data_parallel_start_rank: int
    data_parallel_size_local: int
    health_url: str | None = None  # the node's health port: one node per URL
    hostname: str = ""
    models: list[str] = msgspec.field(default_factory=list)
    ranks: list[RankStatus] = msgspec.field(default_factory=list)


class NodeHeartbeat(msgspec.Struct):
    """The part of a heartbeat the head reads: the ranks' state."""

    ranks: list[RankStatus] = msgspec.field(default_factory=list)


class RegistrationAnswer(msgspec.Struct, kw_only=True):
    """The head's answer to a registration or a heartbeat."""

    accepted: bool = True
    node_id: str = ""
    lease_s: float = 3.0  # the node's ranks leave the view when no heartbeat came for this long
    heartbeat_interval_s: float = 1.0
    data_parallel_size: int = 0
    rendezvous: RegistryRendezvous | None = None




def decode_registration(body: bytes) -> NodeRegistration:
    """Raises ValueError naming the field when ``body`` is not a registration."""
    return json_decoder(NodeRegistration).decode(body)


def decode_heartbeat(body: bytes) -> NodeHeartbeat:
    return json_decoder(NodeHeartbeat).decode(body)


def decode_answer(body: bytes) -> RegistrationAnswer:
    return json_decoder(RegistrationAnswer).decode(body)


class ErrorDetail(msgspec.Struct):
    """The OpenAI-style error every lbd server answers with: ``{"error": {...}}``."""

    message: str = ""
    type: str = ""
    param: str | None = None
    code: int | None = None


class _ErrorAnswer(msgspec.Struct):
    error: ErrorDetail = msgspec.field(default_factory=ErrorDetail)




def decode_error(body: bytes) -> ErrorDetail:
    """The error in a refusal's body; an empty one when the body is not an OpenAI-style error."""
    try:
        return json_decoder(_ErrorAnswer).decode(body).error
    except ValueError:
        return ErrorDetail()
