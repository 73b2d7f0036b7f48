"""Passive outlier detection: eject an endpoint that takes requests but answers none, while others answer.

A rank whose front end still answers /health but whose core is wedged (a stuck step, a hung collective, a
stopped process) passes every probe; what gives it away is its requests. The check, every
``CHECK_INTERVAL_S``: an endpoint is an outlier when (a) its oldest request still waiting for a first body
byte was sent more than ``--outlier-first-byte-timeout-s`` (T) ago, (b) it made no progress in that time (no
first byte of any response, and its scraped ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total``
did not move), and (c) some other endpoint made progress after that request was sent. So a slow but working
rank (a long non-streamed answer, a long prefill) is not ejected, and neither is every rank when the whole
fleet is slow.

An outlier is ejected (``--outlier-max-ejection-percent`` permitting) for ``--outlier-ejection-s``, doubling
with each repeat up to 10x, and the requests waiting on it are cancelled there and retried elsewhere (none of
their bytes reached a client). Then it is half-open: one trial request is sent to it; its first byte re-admits
the endpoint, and its failure, or no first byte within T, ejects it again (the trial is retried elsewhere).
Health probes do not re-admit an outlier: its front end answers them. Bound: a wedged endpoint stops getting
new requests within T + ``CHECK_INTERVAL_S`` of its oldest unanswered request.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import TYPE_CHECKING, Any, Protocol

from lbd.policies import RequestFacts

if TYPE_CHECKING:  # (lbd.router.config imports this module: the endpoints must not be imported that early)
    from lbd.router.endpoints import Endpoint

log = logging.getLogger("lbd.router")
CHECK_INTERVAL_S = 0.5
_MAX_FACTOR = 10.0


def add_outlier_arguments(g: argparse._ArgumentGroup | Any) -> None:
    """`lbd route` flags of this module (in its "telemetry and health" group)."""
    g.add_argument(
        "--outlier-first-byte-timeout-s",
        type=float,
        default=30.0,
        help="eject an endpoint whose requests get no first byte and whose telemetry shows no progress for "
        "this long while other endpoints answer; its waiting requests are retried elsewhere (0: off)",
    )
    g.add_argument(
        "--outlier-ejection-s",
        type=float,
        default=30.0,
        help="first ejection by the outlier checks lasts this long, doubling per repeat (cap 10x); then one "
        "trial request (half-open) decides",
    )
    g.add_argument(
        "--outlier-max-ejection-percent",
        type=float,
        default=50.0,
        help="request outcomes never eject more than this share of the endpoints (at least one)",
    )
    g.add_argument(
        "--outlier-consecutive-5xx",
        type=int,
        default=5,
        help="consecutive failed requests (5xx answers, connection errors) that eject an endpoint",
    )


class Waiter(Protocol):
    """A request attempt waiting for its first byte; ``abandon`` cancels it there (it is then retried)."""

    def abandon(self) -> None: ...


class Fleet(Protocol):
    """What the outlier checks need of the router's endpoints (``lbd.router.endpoints.Fleet``, which records
    every change these checks decide)."""

    endpoints: dict[str, Endpoint]
    half_open: list[Endpoint]
    loop: asyncio.AbstractEventLoop

    def may_eject(self, ep: Endpoint) -> bool: ...

    def readmit(self, ep: Endpoint, why: str) -> None: ...

    def sent(self, ep: Endpoint, attempt: object, now: float, trial: bool = False) -> None: ...

    def answered(self, ep: Endpoint, attempt: object, now: float) -> bool: ...

    def ended(self, ep: Endpoint, attempt: object) -> bool: ...

    def eject(self, ep: Endpoint, now: float, why: str, duration_s: float) -> None: ...

    def open_half(self, ep: Endpoint) -> None: ...

    def forgive(self, ep: Endpoint) -> None: ...


class Outliers:
    """``first_byte_timeout_s`` and ``ejection_s``: --outlier-first-byte-timeout-s, --outlier-ejection-s."""

    def __init__(self, fleet: Fleet, first_byte_timeout_s: float, ejection_s: float) -> None:
        self.fleet = fleet
        self.first_byte_timeout_s = first_byte_timeout_s
        self.ejection_s = ejection_s

    # ---- per request --------------------------------------------------------------------------------
    def trial_for(self, facts: RequestFacts) -> Endpoint | None:
        """A half-open endpoint this request can be the trial of (usually none: one list check)."""
        if not self.fleet.half_open:
            return None
        for ep in self.fleet.half_open:
            if ep.trial is None and ep.routable and not ep.draining and \
                    (facts.pinned_rank is None or facts.pinned_rank == ep.rank) and \
                    (facts.model is None or not ep.models or facts.model in ep.models):
                return ep
        return None

    def sent(self, ep: Endpoint, attempt: Waiter, now: float, trial: bool = False) -> None:
        """The attempt went to ``ep`` (as its half-open trial when ``trial``) and waits for a first byte."""
        self.fleet.sent(ep, attempt, now, trial)

    def answered(self, ep: Endpoint, attempt: Waiter, now: float) -> None:
        """The attempt's first body byte came: the endpoint makes progress."""
        if self.fleet.answered(ep, attempt, now):
            self.fleet.readmit(ep, "half-open trial request answered")

    def ended(self, ep: Endpoint, attempt: Waiter) -> None:
        """The attempt is over (answered or not)."""
        if self.fleet.ended(ep, attempt):  # the trial, ended without a first byte: it failed
            self.eject(ep, self.fleet.loop.time(), "half-open trial request failed")

    # ---- periodic -----------------------------------------------------------------------------------
    def check(self, now: float) -> None:
        window = self.first_byte_timeout_s
        if window <= 0:
            return
        eps = list(self.fleet.endpoints.values())
        for ep in eps:
            if ep.ejected_by == "outlier" and not ep.half_open and now >= ep.readmit_at:
                self.fleet.open_half(ep)
                log.info("endpoint half-open: %s (rank %s): the next request is its trial", ep.url, ep.rank)
            elif ep.half_open and ep.trial is not None and now - ep.waiting.get(ep.trial, now) > window:
                # eject() drops the trial and abandons it with the other waiting attempts: it is retried
                self.eject(ep, now, f"half-open trial request got no first byte within {window:g} s")
            elif ep.healthy and ep.outlier_ejections and now - ep.ejected_at > _MAX_FACTOR * self._base():
                self.fleet.forgive(ep)  # healthy for long: the next ejection is short again
        for ep in eps:
            if not ep.healthy or not ep.routable or not ep.waiting:
                continue
            oldest = next(iter(ep.waiting.values()))
            if now - oldest <= window or now - ep.progress_at <= window:
                continue
            if not any(e is not ep and e.progress_at >= oldest for e in eps):
                continue  # nobody answered since: a slow fleet or no traffic, not one bad endpoint
            if not self.fleet.may_eject(ep):
                continue
            self.eject(ep, now, f"no first byte within {window:g} s for {len(ep.waiting)} requests while "
                                "other endpoints answer")

    def eject(self, ep: Endpoint, now: float, why: str) -> None:
        """Eject ``ep`` for the base time, doubled per repeat up to ``_MAX_FACTOR``; its waiting attempts
        are abandoned there (and retried elsewhere)."""
        duration = min(self._base() * 2 ** ep.outlier_ejections, _MAX_FACTOR * self._base())
        self.fleet.eject(ep, now, why, duration)
        log.warning("endpoint ejected: %s (rank %s): %s; %d waiting requests retried elsewhere; trial in "
                    "%.0f s", ep.url, ep.rank, why, len(ep.waiting), duration)
        for attempt in list(ep.waiting):
            attempt.abandon()

    def _base(self) -> float:
        return self.ejection_s
