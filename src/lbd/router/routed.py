"""What the proxy's steps hand one another: the request on its way (``RoutedRequest``), one try on one
endpoint (``Attempt``), and the two ways a step ends early (``Refused``: an answer instead of routing;
``Failure``: a try that failed before any byte reached the client).

The request path (``lbd.router.proxy``): admit -> facts -> decide -> attempt -> relay (``lbd.router.relay``).
The policies see only ``RoutedRequest.facts``; the rest is the router's own bookkeeping.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lbd.policies import Decision, EndpointSnapshot, RequestFacts
from lbd.router.endpoints import Endpoint
from lbd.router.messages import Request

if TYPE_CHECKING:
    from lbd.router.kv.cold import Deferred
    from lbd.router.kv.forward import ExactPrompt
    from lbd.router.metering import Bill
    from lbd.router.tracing import RouteTrace


@dataclass(slots=True, eq=False)
class RoutedRequest:
    """One request through the steps. ``admit`` makes it (request id, arrival time, parsed facts); ``facts``
    adds the exact view's facts and the headers to forward; ``decide`` keeps the endpoints' snapshots and the
    ones this request may not go to (full, or failed it already)."""

    request: Request
    body: bytes  # the request's body, read once
    rid_header: bytes  # our "X-Request-Id: ...\r\n" line, for the upstream and the client
    t0: float  # loop time it arrived (--retry-budget-s counts from here)
    facts: RequestFacts
    data: dict[str, Any] | None = None  # the parsed body (the exact view tokenizes its prompt)
    trace: RouteTrace | None = None
    headers: bytes = b""  # the client's headers as forwarded upstream, with ours
    # the exact view's bookkeeping (lbd.router.kv.lookup): a prompt routed on its head whose tokenization
    # still runs (a cold.Deferred) or was skipped (cold.HEAD_ONLY); the prompt's ids for ranks that take them
    deferred: Deferred | str | None = None
    prompt_ids: ExactPrompt | None = None
    # set by ``decide`` on the first try:
    snaps: list[EndpointSnapshot] = field(init=False)
    exclude: list[str] = field(init=False)  # keys: full (--max-streams-per-endpoint) or failed it
    full: int = 0  # how many of ``exclude`` were full when the request arrived
    pd_exclude: Sequence[str] = ()  # a P/D decode stage's non-decode ranks (set by lbd.router.disagg)
    move: Any = None  # a stream that may move to another rank mid-stream (lbd.router.migration.Move)
    bill: Bill | None = None  # its key's token charge, settled on the output (lbd.router.metering)

    @property
    def request_id(self) -> str:
        """The X-Request-Id value (``rid_header`` may carry more header lines after it, e.g. P/D's)."""
        return self.rid_header.split(b"\r\n", 1)[0][14:].decode("latin-1")


@dataclass(slots=True)
class Refused:
    """An OpenAI-style error answer sent instead of routing; ``headers``: serialized header lines."""

    status: int
    message: str
    type: str
    param: str | None = None
    headers: bytes = b""


@dataclass(slots=True)
class Failure:
    """An attempt that failed before any byte reached the client."""

    status: int
    message: str
    kind: str  # metric label: connect, upstream_gone, overloaded, upstream_5xx, response_timeout
    retryable: bool
    body: bytes | None = None  # an upstream's own error body, passed through if no retry is left
    content_type: str = "application/json"


@dataclass(slots=True, eq=False)
class Attempt:
    """One try of a request on one endpoint, from dispatch to its end (``Endpoint.waiting`` holds it until its
    first byte: the outlier checks read it there)."""

    ep: Endpoint
    decision: Decision
    charge: int  # prefill tokens it adds to the endpoint's backlog until its first byte
    dispatched_at: float
    task: asyncio.Task[None] | None
    started: bool = False  # its first byte went to the client: no retry from here on
    pending: object = None  # the exact view's token for the blocks this request computes
    abandoned: bool = False

    def abandon(self) -> None:
        """Cancel the wait for a first byte (the outlier check ejected the endpoint); it is retried."""
        if not self.abandoned and not self.started and self.task is not None:
            self.abandoned = True
            self.task.cancel()


class ClientGone(Exception):
    """The client is gone (or the connection was cut on purpose) after the answer began."""
