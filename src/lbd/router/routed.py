"""What the proxy's steps hand one another: the request on its way (``RoutedRequest``), one try on one
endpoint (``Attempt``), and the two ways a step ends early (``Refused``: an answer instead of routing;
``Failure``: a try that failed before any byte reached the client).

The request path (``lbd.router.proxy``): admit -> facts -> [move, P/D] -> decide -> attempt -> relay
(``lbd.router.relay``). The policies see only ``RoutedRequest.facts``; the rest is the router's own
bookkeeping. Each step writes its own fields once (``RoutedRequest`` names them by step); what P/D settles
as a whole is a small frozen object (``PdStage``), so a later step cannot undo an earlier one's work (as a
P/D body rebuild once dropped the migrator's ``return_token_ids``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lbd.policies import Decision, EndpointSnapshot, Filter, RequestFacts
from lbd.policies.filters import GATE
from lbd.router.endpoints import Endpoint
from lbd.router.messages import Request

if TYPE_CHECKING:
    from lbd.router.kv.cold import Deferred
    from lbd.router.kv.forward import ExactPrompt
    from lbd.router.metering import Bill
    from lbd.router.tracing import RouteTrace


@dataclass(slots=True, frozen=True)
class PdStage:
    """What prefill/decode disaggregation settled for a request (``lbd.router.disagg``), set once before the
    decode stage is decided: where that stage may go (``gate``), what it sends (``body``) and what the
    client's answer says about it (``header``)."""

    outcome: str  # the x-lbd-disagg value: "pd <prefill rank>" or "colocated (<reason>)"
    header: bytes  # the answer's header lines: x-lbd-disagg (and, with --debug-headers, the prefill's reason)
    gate: tuple[Filter, ...] = GATE  # the decode stage's gate: the router's, or with the decode role's rule
    body: bytes | None = None  # the decode stage's body (the prefill's kv_transfer_params added); None: as is
    prefill: Decision | None = None  # the prefill stage's decision (its rank and the plugin that decided)


@dataclass(slots=True, eq=False)
class RoutedRequest:
    """One request through the steps, each writing its own fields once: ``admit`` makes it (request id,
    arrival time, parsed facts, the key's bill); ``facts`` adds the headers to forward and the exact view's
    bookkeeping; the migrator the ``move`` (and ``ids_body``, the body asking for token ids); P/D its ``pd``
    stage; ``decide`` (first try) the ``snaps`` it chose among and the ``full`` ones.
    ``exclude`` is the retries' list: the endpoints that failed this request, appended as they do."""

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
    bill: Bill | None = None  # its key's token charge, settled on the output (lbd.router.metering; admit)
    move: Any = None  # a stream that may move to another rank mid-stream (lbd.router.migration.Move)
    ids_body: bytes | None = None  # the migrator's: ``body`` asking for the answer's token ids (for a move)
    pd: PdStage | None = None  # the P/D stage's outcome (lbd.router.disagg); None: not a P/D router's
    sent_to: str | None = None  # the endpoint its latest try went to (``decide``)
    # set once by ``decide`` on the first try (plain fields, not an object: this runs on every request)
    snaps: list[EndpointSnapshot] = field(init=False)  # what it chose among (a sample of a large fleet)
    full: Sequence[str] = field(init=False)  # keys full when it arrived (--max-streams-per-endpoint)
    exclude: list[str] = field(init=False)  # endpoints that failed it (created by ``decide``, then appended)

    @property
    def request_id(self) -> str:
        """The X-Request-Id value."""
        return self.rid_header[14:-2].decode("latin-1")

    @property
    def own_body(self) -> bytes:
        """The body before P/D: the request's, asking for token ids where the migrator wants them."""
        ids = self.ids_body
        return self.body if ids is None else ids

    @property
    def forward_body(self) -> bytes:
        """The body an attempt sends: P/D's decode body (``own_body`` and its params), else ``own_body``."""
        pd = self.pd
        return self.own_body if pd is None or pd.body is None else pd.body

    @property
    def reply_headers(self) -> bytes:
        """Our header lines on the client's answer: the request id, and what P/D did."""
        pd = self.pd
        return self.rid_header if pd is None else self.rid_header + pd.header

    @property
    def gate(self) -> tuple[Filter, ...]:
        """The filters that may refuse this request's decisions: the router's gate, or a P/D decode stage's"""
        pd = self.pd
        return GATE if pd is None else pd.gate


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
