"""How busy a rank is by what it serves (issue 46): its token throughput against the most it was seen to
serve while requests queued in its engine.

Flow control's thresholds (queued prompt tokens, waiting requests, KV use) see a rank that runs out of KV or
queues prefill, but not one that is compute-bound: a CPU rank decoding ten streams has no queue and little KV
in use, yet one more rank's load would slow every stream past the TTFT target. Throughput sees it: a rank
that serves ``rate`` tokens per second, where a saturated rank of the fleet served ``capacity``, is
``rate / capacity`` busy, whatever bound it (compute, KV, prefill).

- ``TokenRate``: a rank's prompt plus generated tokens per second, an exponential average (time constant
  ``tau_s``) over its telemetry's cumulative counters (scraped or pushed); a counter that goes down (a
  restarted rank) starts it over.
- ``Capacity``: the highest such rate of a rank whose engine had waiting requests for two time constants
  (it could go no faster), for the fleet (its ranks alike: one model, one device kind). Unknown (0) until
  some rank has been saturated that long: then this signal says nothing and the others decide. It is a rate
  under the fleet's own mix of prompt and generated tokens; a mix that serves more tokens a second raises
  it, one that serves fewer does not lower it (the signal then reads low, as queue and KV alone do).
- ``Offered``: the tokens per second of the work still arriving at a rank: the prompt tokens it took in plus,
  for each request sent to it, the fleet's generated tokens per finished request (``OutputSize``). In a
  steady load it reads what the rank serves; after the load drops, what a rank serves runs ahead of it for as
  long as the streams of the passed load decode (on CPU ranks, 500-token streams for 20-30 s). Those streams
  need no rank of their own (a removed rank's streams resume on the ranks that stay), so the autoscaling rule
  counts served tokens only in the share the fleet's offered tokens make of them
  (``lbd.router.autoscale_signals``): never more than served, so the measure can only read a fleet less
  busy, never ask for a rank that the served tokens would not.
"""

from __future__ import annotations

import math

TAU_S = 5.0
OUTPUT_TAU_S = 60.0  # OutputSize: longer than a long stream, so its tokens and its end fall together
OUTPUT_MIN_REQUESTS = 5.0  # finished requests (decayed) before OutputSize says anything


class TokenRate:
    """One rank's tokens per second (prompt + generated), averaged over ``tau_s``, and since when its engine
    has had waiting requests in every reading (``saturated_since``; None: not now)."""

    __slots__ = ("tau_s", "rate", "saturated_since", "_tokens", "_at", "_primed")

    def __init__(self, tau_s: float = TAU_S) -> None:
        self.tau_s = tau_s
        self.rate = 0.0
        self.saturated_since: float | None = None
        self._tokens: float | None = None
        self._at = 0.0
        self._primed = False  # a rate was measured over one interval at least

    def update(self, tokens: float, at: float, waiting: bool = False) -> float:
        """The counters read ``tokens`` at time ``at`` (seconds, any monotonic origin), with requests
        ``waiting`` in the engine or not; the new rate."""
        if not waiting:
            self.saturated_since = None
        elif self.saturated_since is None:
            self.saturated_since = at
        last, self._tokens = self._tokens, tokens
        if last is None or tokens < last:  # the first reading, or a new process: start over
            self._at, self.rate, self.saturated_since, self._primed = at, 0.0, None, False
            return self.rate
        dt = at - self._at
        if dt <= 0.0:
            self._tokens = last  # the same instant: keep the older reading for the next interval
            return self.rate
        # the first interval is all it knows; later ones weigh by their length
        weight = 1.0 - math.exp(-dt / self.tau_s) if self._primed else 1.0
        self._at, self._primed = at, True
        self.rate += weight * ((tokens - last) / dt - self.rate)
        return self.rate

    @property
    def primed(self) -> bool:
        """A rate was measured (two readings at least)."""
        return self._primed

    def saturated(self, at: float) -> bool:
        """Saturated long enough (two time constants) for the average to be the saturated rate."""
        return self.saturated_since is not None and at - self.saturated_since >= 2.0 * self.tau_s


class Capacity:
    """The fleet's tokens per second of a saturated rank (0: not seen yet): the highest rate of a rank read
    after two time constants of saturation, so a start-up burst (a rank slow while it warms) or a moment's
    queue is not taken for the limit. The highest, not the latest: a rank can saturate at a low token rate
    (its KV cache full of long streams, which decode few tokens a second), and that reading would make
    every rank look busy (sim ranks: 5.7 ranks kept where 4 serve the load, and flapping at 1x)."""

    __slots__ = ("tokens_per_s",)

    def __init__(self) -> None:
        self.tokens_per_s = 0.0

    def observe(self, rate: TokenRate, at: float) -> None:
        if rate.saturated(at) and rate.rate > self.tokens_per_s:
            self.tokens_per_s = rate.rate

    def busy(self, rate: float) -> float:
        """``rate`` as a fraction of the capacity (0 while it is unknown)."""
        return rate / self.tokens_per_s if self.tokens_per_s > 0 else 0.0


class OutputSize:
    """The fleet's generated tokens per finished request: the ranks' generated tokens and the router's
    finished requests, each summed with exponential decay (time constant ``tau_s``), one over the other.
    Tokens are counted as they are generated and requests as they end, so the ratio is the mean output only
    over a window longer than a stream: 60 s. 0 until ``OUTPUT_MIN_REQUESTS`` ended (unknown)."""

    __slots__ = ("tau_s", "tokens", "requests", "_at")

    def __init__(self, tau_s: float = OUTPUT_TAU_S) -> None:
        self.tau_s = tau_s
        self.tokens = 0.0
        self.requests = 0.0
        self._at: float | None = None

    def observe(self, generated: float, finished: float, at: float) -> None:
        """A rank generated ``generated`` tokens and ended ``finished`` requests since its last reading."""
        if self._at is not None and at > self._at:
            decay = math.exp(-(at - self._at) / self.tau_s)
            self.tokens *= decay
            self.requests *= decay
        self._at = at if self._at is None else max(self._at, at)
        self.tokens += max(0.0, generated)
        self.requests += max(0.0, finished)

    @property
    def per_request(self) -> float:
        return self.tokens / self.requests if self.requests >= OUTPUT_MIN_REQUESTS else 0.0


class Offered:
    """One rank's offered tokens per second (module docstring): its counters' last readings and the rate,
    a ``TokenRate`` over a running total of prompt tokens taken in plus requests sent times ``OutputSize``.
    ``known`` once the fleet's output size is known and two readings made a rate."""

    __slots__ = ("rate", "total", "_last")

    def __init__(self, tau_s: float = TAU_S) -> None:
        self.rate = TokenRate(tau_s)
        self.total = 0.0
        self._last: tuple[float, float, int, int] | None = None  # prompt, generated, sent, finished

    def update(self, prompt: float, generated: float, sent: int, finished: int, at: float,
               output: OutputSize) -> None:
        """The rank's counters (``prompt``/``generated`` tokens: its engine's; ``sent``/``finished``
        requests: the router's) at ``at``; feeds ``output`` with what it generated and ended meanwhile. A
        counter that went down (a new process, a new slot) is a new start: nothing counted for it."""
        last, self._last = self._last, (prompt, generated, sent, finished)
        if last is not None and prompt >= last[0] and generated >= last[1] and sent >= last[2] \
                and finished >= last[3]:
            output.observe(generated - last[1], finished - last[3], at)
            self.total += (prompt - last[0]) + (sent - last[2]) * output.per_request
        if output.per_request > 0:  # from the first reading with an output size on (an honest first rate)
            self.rate.update(self.total, at)

    def tokens_per_s(self) -> float | None:
        """The offered rate, None while unknown."""
        return self.rate.rate if self.rate.primed else None
