"""Which headers cross the router, serialized as raw bytes (no decode/encode per header).

Requests: the client's headers minus hop-by-hop ones (Host and Content-Length are the pool's), our request
id, and (when tracing) our span's trace context instead of the client's. Responses: the upstream's headers
minus hop-by-hop ones, Date and Server, plus ours. Both sides repeat themselves request after request, so a
client's header set is serialized once and an upstream header name is judged once (bounded caches).
"""

from __future__ import annotations

from lbd.router.facts import PIN_HEADER
from lbd.router.messages import Headers

_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
                  "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length"})
REQUEST_DROP = frozenset(h.encode() for h in _HOP | {"x-request-id"})
REQUEST_DROP_UNPINNED = REQUEST_DROP | {PIN_HEADER.lower().encode()}  # a pin the fallback must not forward
TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})
RESPONSE_DROP = frozenset(h.encode() for h in _HOP | {"date", "server", "x-request-id"})
_CACHE = 1024  # entries of either cache before it is cleared


class HeaderRewriter:
    def __init__(self) -> None:
        self._requests: dict[tuple[tuple[tuple[bytes, bytes], ...], frozenset[bytes]], bytes] = {}
        self._keep: dict[bytes, bool] = {}

    def request(self, h: Headers, drop: frozenset[bytes]) -> bytes:
        """The client's header lines that go upstream (without ours)."""
        key = (tuple(h.raw), drop)
        kept = self._requests.get(key)
        if kept is None:
            kept = b"".join([b"%s: %s\r\n" % kv for kv, name in zip(h.raw, h.names, strict=True)
                             if name not in drop])
            if len(self._requests) >= _CACHE:
                self._requests.clear()
            self._requests[key] = kept
        return kept

    def response(self, raw: list[tuple[bytes, bytes]]) -> list[bytes]:
        """The upstream's header lines that go to the client."""
        keep, parts = self._keep, []
        for kv in raw:
            kept = keep.get(kv[0])
            if kept is None:
                kept = keep[kv[0]] = kv[0].lower() not in RESPONSE_DROP
                if len(keep) > _CACHE:
                    keep.clear()
            if kept:
                parts.append(b"%s: %s\r\n" % kv)
        return parts
