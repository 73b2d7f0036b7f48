"""The three plugin types of a routing decision, the state they learn, and what one decision carries.

A decision is filters, then scorers, then a picker (as in llm-d's scheduler):
- a ``Filter`` drops endpoints (``filter`` returns the indices it keeps; the router's gate filters may also
  settle the request, a pin, or refuse it);
- a ``Scorer`` gives every endpoint a number, lower is better (``score``); a profile sums them by weight;
- the ``Picker`` takes one of the kept endpoints by the summed scores (``pick``).

Every plugin may name the decision (``reason``, a low-cardinality label, and ``detail``, a line for people):
the first that claims it is the plugin that decided (filters, then the picker, then the scorers by how far
each one's weighted score put the pick ahead of the runner-up).

What a plugin learns from the router's hooks (a prefix index, a rate, a footprint) lives in a ``Learned``
object: explicit, shared by the plugins of one profile that ask for the same kind, and forgotten by
``reset``. Plugins read no clock and do no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

from lbd.policies.base import Decision, EndpointSnapshot, Refusal, RequestFacts, queue_scores

Detail = str | Callable[[], str]
L = TypeVar("L", bound="Learned")


class Learned:
    """State learned from the router's hooks. Subclasses override the hooks they need and ``reset``."""

    __slots__ = ()

    def on_dispatch(self, facts: RequestFacts, key: str) -> None:
        """The request was sent to ``key`` (whoever chose it: a plugin, a pin or a retry)."""

    def on_chain_known(self, facts: RequestFacts, key: str, head_blocks: int) -> None:
        """A request routed on the head of its block chain has its whole chain in ``facts`` now."""

    def on_first_byte(self, decision: Decision, ttft_s: float) -> None:
        """The answer's first byte came ``ttft_s`` after dispatch."""

    def forget(self, key: str) -> None:
        """The endpoint ``key`` is gone (or restarted): nothing it held is known any more."""

    def reset(self) -> None:
        """Forget everything learned."""
        raise NotImplementedError


class Env:
    """What a plugin is built with: the profile's settings and its shared learned state."""

    __slots__ = ("stale_s", "seed", "learned")

    def __init__(self, stale_s: float = 1.0, seed: int = 0) -> None:
        self.stale_s = stale_s
        self.seed = seed
        self.learned: dict[type[Learned], Learned] = {}

    def state(self, kind: type[L], **options: Any) -> L:
        """The profile's one ``kind`` of learned state (built by the first plugin that asks)."""
        have = self.learned.get(kind)
        if have is None:
            have = self.learned[kind] = kind(**options)
        return have  # type: ignore[return-value]


class Context:
    """One decision: the request, the endpoints (``pool``, indexed by every filter, scorer and picker) and
    what the plugins computed on the way (``memo``, keyed by plugin), so none computes a number twice."""

    __slots__ = ("facts", "pool", "stale_s", "exclude", "pin_fallback", "kept", "totals", "memo",
                 "turns_before", "rotates", "_queue")

    def __init__(self, facts: RequestFacts, pool: Sequence[EndpointSnapshot], stale_s: float,
                 exclude: Any = (), pin_fallback: bool = False) -> None:
        self.facts = facts
        self.pool = pool
        self.stale_s = stale_s
        self.exclude = exclude
        self.pin_fallback = pin_fallback
        self.kept: list[int] = []  # what the profile's filters kept (set before scoring)
        self.totals: list[float] | None = None
        self.memo: dict[Any, Any] = {}
        # the picker's turn: it uses its counter + ``turns_before`` and advances it only if ``rotates``
        self.turns_before = 0
        self.rotates = True
        self._queue: list[float] | None = None

    def queue(self) -> list[float]:
        """``queue_score`` of every endpoint (computed once per decision: several plugins read it)."""
        q = self._queue
        if q is None:
            q = self._queue = queue_scores(self.pool, self.stale_s)
        return q


class Plugin:
    """What filters, scorers and pickers share: a registered name, a help line, the request facts they read
    and how they explain a decision."""

    kind: ClassVar[str] = ""
    name: ClassVar[str] = ""
    help: ClassVar[str] = ""
    uses_prefix_hashes: ClassVar[bool] = False  # reads RequestFacts.prefix_hashes (the router hashes text)
    exact_aware: ClassVar[bool] = False  # reads RequestFacts.cached_tokens (the exact view)
    uses_load: ClassVar[bool] = True  # reads the snapshots' live load (in flight, delta, age)

    def __init__(self, env: Env, **options: Any) -> None:
        if options:
            raise TypeError(f"{self.kind} {self.name!r} takes no option {sorted(options)[0]!r}")
        self.stale_s = env.stale_s

    def reason(self, ctx: Context, pick: int) -> str | None:
        """The decision's label if this plugin decided it (None: it did not)."""
        return None

    def detail(self, ctx: Context, pick: int) -> Detail | None:
        """The decision's line for people, in this plugin's numbers (None: none of its own)."""
        return None


class Filter(Plugin):
    kind = "filter"

    def filter(self, ctx: Context, kept: list[int]) -> list[int] | Decision | Refusal:
        """The indices of ``ctx.pool`` it keeps, of ``kept``. A profile's filter that would keep none is
        skipped (a preference, not a rule); the router's gate filters return a Decision or a Refusal."""
        raise NotImplementedError


class Scorer(Plugin):
    kind = "scorer"
    claims: bool = True  # whether ``reason`` may name the decision

    def score(self, ctx: Context) -> list[float]:
        """A number per endpoint of ``ctx.pool``, lower is better."""
        raise NotImplementedError

    def reason(self, ctx: Context, pick: int) -> str | None:
        return self.name

    def annotate(self, ctx: Context, pick: int, decision: Decision) -> None:
        """Add this scorer's prediction to the decision (what a learning hook compares later)."""

    def charge_tokens(self, facts: RequestFacts, ep: EndpointSnapshot) -> float | None:
        """Prefill tokens the request adds to ``ep``'s queue (None: not this scorer's to say)."""
        return None


class Picker(Plugin):
    kind = "picker"

    def pick(self, ctx: Context, kept: list[int], totals: list[float] | None) -> int:
        """One of ``kept`` (an index of ``ctx.pool``) by the summed scores (None: no scorers)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget the rotation (and any randomness drawn)."""
