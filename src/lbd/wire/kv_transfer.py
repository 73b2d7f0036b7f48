"""Prefill/decode disaggregation's wires: the HTTP ``kv_transfer_params`` (vLLM's field names) and the
messages of the KV-block pull between two engine cores (ZMQ, msgpack).

HTTP (vLLM's contract, as its disaggregation proxy and vllm-router's vLLM PD mode use it):
- a prefill request carries ``kv_transfer_params`` with ``do_remote_decode: true`` (and ``max_tokens`` 1);
- its response carries ``kv_transfer_params`` with ``do_remote_prefill: true``, ``remote_engine_id``,
  ``remote_block_ids``, ``remote_host``, ``remote_port``, ``remote_request_id``, ``tp_size``;
- the decode request carries those back; the decode rank pulls the blocks it lacks before its first step.

Pull (consumer DEALER -> producer ROUTER): ``KVPull`` names the producer's engine id, the transfer (the
prefill's request id) and the producer's block ids wanted; the answer is ``[KVBlocksHeader, data]``: the
blocks' bytes in the order asked, each block ``block_bytes`` long, and the layout the bytes follow (both
sides must agree on it, else the consumer recomputes). A pull of no blocks tells the producer to free them.
A NIXL consumer asks for ``transport="nixl"``: a producer with NIXL then answers where to READ the blocks
(``NixlRemote``, with its agent's metadata unless the consumer has it) instead of their bytes, and releases
them when the READ's notification arrives (carrying the lend's ``notif``); one without NIXL sends the bytes.
Trust (``lbd.engine.kv_transfer.trust``): a pull carries a fresh challenge and the header the producer's
proof that it holds the transfer key; a response's params carry the producer's signature (``lbd_sig``); a
request's ``remote_host`` is an address, never a name.
Standard library and msgspec only.
"""

from __future__ import annotations

import ipaddress
from typing import Any

import msgspec


class KVTransferParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    """``kv_transfer_params`` of a request or a response (vLLM's NixlConnector field names); fields this
    version does not know are skipped."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[Any] | None = None  # ints, or one list of ints per KV-cache group
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    tp_size: int = 1
    lbd_sig: str | None = None  # the producer's HMAC over the fields above (lbd.engine.kv_transfer.trust)

    def block_ids(self) -> list[int]:
        """The producer's block ids (vLLM sends one list, or one list per KV-cache group: the first)."""
        ids = self.remote_block_ids or []
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
            raise ValueError("kv_transfer_params.remote_block_ids must be block ids (integers >= 0)")
        return list(ids)


class KVPull(msgspec.Struct):
    """Consumer -> producer: the blocks of one transfer (beyond loopback the channel is CURVE-secured with
    keys derived from the cluster token, ``lbd.common.cluster``). ``token_ids``: the consumer's prompt up to
    the end of the last block wanted; the producer answers only if its prefill had exactly these tokens there
    (a block's KV depends on every token before it), so no client can pair one prompt's KV with another's."""

    engine_id: str
    transfer_id: str
    block_ids: list[int]
    token_ids: list[int] = msgspec.field(default_factory=list)
    transport: str = "bytes"  # "nixl": answer with a NixlRemote, the consumer READs the blocks itself
    nixl_known: bool = False  # the consumer holds the producer's NIXL agent metadata already
    challenge: bytes = b""  # fresh per pull: the producer answers with a proof that it holds the key


class KVBlocksHeader(msgspec.Struct):
    """Producer -> consumer, the first frame of the answer; the second frame holds ``len(block_ids) *
    block_bytes`` bytes when ``ok``."""

    transfer_id: str
    ok: bool
    error: str = ""
    layout: str = ""  # the KV layout the bytes follow (dtype, per-tensor block shapes)
    block_bytes: int = 0
    num_blocks: int = 0
    transport: str = "bytes"  # what the second frame holds: the blocks' bytes, or a NixlRemote
    proof: str = ""  # the HMAC of the pull's challenge with the transfer key (lbd.engine.kv_transfer.trust)


class NixlRemote(msgspec.Struct):
    """Where a NIXL consumer READs a producer's blocks: the producer's agent (its metadata, empty when the
    consumer said it has it) and, per KV-cache tensor in layout order, its base address and bytes per block
    (block b of tensor i starts at ``regions[i][0] + b * regions[i][1]``)."""

    agent: str
    metadata: bytes
    regions: list[tuple[int, int]]
    mem_type: str  # NIXL's: DRAM (a CPU cache) or VRAM
    dev_id: int = 0
    notif: str = ""  # fresh per lend: the READ's notification must carry it to end the lease


_ENCODER = msgspec.msgpack.Encoder()
_PULL = msgspec.msgpack.Decoder(KVPull)
_HEADER = msgspec.msgpack.Decoder(KVBlocksHeader)
_NIXL = msgspec.msgpack.Decoder(NixlRemote)


def encode(msg: object) -> bytes:
    return _ENCODER.encode(msg)


def decode_pull(payload: bytes) -> KVPull:
    """ValueError (msgspec.DecodeError) for a payload that is not a KVPull."""
    return _PULL.decode(payload)


def decode_header(payload: bytes) -> KVBlocksHeader:
    return _HEADER.decode(payload)


def decode_nixl_remote(payload: bytes) -> NixlRemote:
    return _NIXL.decode(payload)


def params_from_obj(obj: Any) -> KVTransferParams:
    """``kv_transfer_params`` as a client sent it (a JSON object); ValueError naming the field when a known
    field has the wrong type."""
    if not isinstance(obj, dict):
        raise ValueError("kv_transfer_params must be a JSON object")
    try:
        params = msgspec.convert(obj, KVTransferParams, strict=True)
    except msgspec.ValidationError as e:
        raise ValueError(f"kv_transfer_params: {e}") from None
    params.block_ids()
    host = params.remote_host
    if host is not None and host != "localhost" and not _ip_literal(host):
        raise ValueError("kv_transfer_params.remote_host must be an IP address (a rank never resolves a name "
                         "a request gives it)")
    return params


def _ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def params_to_obj(params: KVTransferParams) -> dict[str, Any]:
    """The JSON object of a response's ``kv_transfer_params``, every vLLM field written (as vLLM does), and
    the producer's signature when there is one."""
    return {name: getattr(params, name) for name in params.__struct_fields__
            if name != "lbd_sig" or params.lbd_sig is not None}
