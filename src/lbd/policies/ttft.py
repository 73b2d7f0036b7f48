"""Time-to-first-token scorers: the estimate itself (``ttft``), the reuse charge (``reuse``) and the eviction
charge (``evict``); the predicted_ttft profile sums them.

Estimate per endpoint, in prefill-token equivalents divided by a prefill rate (tokens/s):
    tokens ahead   = the router's own requests there without a first byte yet (their uncached tokens, exact)
                   + other clients' waiting requests x the average prompt length seen
    decode drag    = running requests x ``running_tokens`` (each takes a slot of every step's token budget)
    requests ahead = the requests there without a first token yet x ``request_tokens`` (what a request costs
                     its rank beyond its prefill tokens: scheduling, tokenizing, streaming)
    this request   = its prompt minus the prefix that endpoint already holds: exact where the router follows
                     the endpoint's KV-cache events (``facts.cached_tokens``), else the approximate index
    KV pressure    = ``kv_penalty_tokens`` x how far KV use is past ``kv_threshold`` (near full = preemption)
The rate is a setting, or learned from observed times to first byte (EWMA) when not given (``TtftModel``);
then the two load prices (``running_tokens``, ``request_tokens``) are learned too, by a least-squares fit of
the first bytes' times on the estimate's parts. With the settings' prices (16 tokens a running request, a
request ahead only its tokens) a hot prefix's holder kept its sessions while it ran 3-4x the fleet's least
load; on a fleet whose ranks are short of CPU each request there costs the next one's first token far more
than its prefill tokens (issue 42: ~5 ms a running request and ~35 ms a request ahead, against ~0.02 ms a
prefill token, on 8 sim ranks sharing 2 cores).
``reuse`` scores this request's uncached tokens: a token computed again where another rank holds it delays
everything queued behind it there, so between two near-equal estimates the one that reuses the cache wins,
while a rank whose queue outgrows the saving loses the request (a hot prefix spreads). A prefix still being
computed earns no credit it would wait for (``wait_bound``): of the prefix pending on an endpoint (sent there
to compute, its KV events not in yet: ``RequestFacts.pending_tokens``), the part as long as the prefill queued
there beyond the shortest such queue is charged as uncached. Issue 42's burst: sessions sharing a cold
system prompt arrive while its first request computes it; the exact view counts that prefix cached there,
and with the full credit every follower stacked behind the one prefill (when it stalled, the whole group
stalled: 2.1-2.6 s against ~1.1 s for a recompute on an idle rank). Held prefixes keep the whole credit
(bounding it by every queue cost many-tenant 7-10 points of prefix hits).
``evict`` scores the hot prefix tokens a placement would push out of that endpoint's cache (``Footprint``:
other prefixes served there lately plus this prompt, past ``kv_threshold`` of its KV blocks): evicting a
tenant's prefix costs its next request that prefix again, so cold prefixes go where there is room.
"""

from __future__ import annotations

from lbd.policies.base import Decision, EndpointSnapshot, RequestFacts
from lbd.policies.footprint import Footprint, root_of
from lbd.policies.plugin import Context, Detail, Env, Learned, Scorer
from lbd.policies.prefix import CHUNK_CHARS, PrefixIndex, PrefixMemory
from lbd.policies.registry import plugin

CHARS_PER_TOKEN = 4  # the router's prompt-length estimate; it never tokenizes
QUEUED = "ttft.queued"  # ctx.memo: prefill tokens queued ahead per endpoint (reuse bounds its credit by it)
WAIT_CUT = "reuse.wait_cut"  # ctx.memo: each endpoint's credit cut by its queue (the reason names it)


class TtftModel(Learned):
    """The prefill rate (learned from times to first byte unless fixed), the average prompt length, and what
    the requests already on an endpoint cost a new one's first token, in prefill tokens: each running request
    (``running_tokens``) and each request queued ahead of it without a first token yet (``request_tokens``).

    With the rate learned, those two are learned too: an exponentially weighted least-squares fit (about the
    last ``load_window`` first bytes) of the time to first byte on the estimate's parts at dispatch (prefill
    tokens, running requests, requests ahead; see ``Decision.load``), each part's seconds over the tokens'
    seconds. A request's cost beyond its prefill tokens is whatever its rank spends on it outside the forward
    pass (scheduling, tokenizing and detokenizing, streaming; on a host short of CPU, most of a first token's
    time): a fixed guess is right on one fleet and wrong by 100x on the next. ``running_tokens`` never goes
    under its setting; neither goes past ``LOAD_TOKENS_MAX``. Until ``LOAD_MIN_SAMPLES`` first bytes the
    settings hold (``request_tokens`` 0)."""

    __slots__ = ("fixed", "learn", "rate", "alpha", "avg_prompt_tokens", "running_floor", "running_tokens",
                 "request_tokens", "window", "_sums", "_seen")

    def __init__(self, prefill_tokens_per_s: float | None = None, learn_alpha: float = 0.1,
                 running_tokens: float = 16.0, load_window: int = 256) -> None:
        self.fixed = prefill_tokens_per_s
        self.learn = prefill_tokens_per_s is None
        self.alpha = learn_alpha
        self.running_floor = running_tokens
        self.window = max(2, load_window)
        self.reset()

    def reset(self) -> None:
        self.rate = float(self.fixed or 4000.0)
        self.avg_prompt_tokens = 256.0
        self.running_tokens = self.running_floor
        self.request_tokens = 0.0
        self._sums = [0.0] * 14  # the fit's X'X (upper triangle, 4 x 4) and X'y, exponentially weighted
        self._seen = 0

    def on_dispatch(self, facts: RequestFacts, key: str) -> None:
        if facts.prompt_tokens:
            self.avg_prompt_tokens += 0.05 * (facts.prompt_tokens - self.avg_prompt_tokens)

    def on_first_byte(self, decision: Decision, ttft_s: float) -> None:
        if not self.learn or ttft_s <= 0.0:
            return
        if decision.load is not None:
            self._observe(decision.load, ttft_s)
        # Tiny estimates are all overhead (HTTP, scheduling), not prefill: they would inflate the rate.
        if decision.cost_tokens < 64 or ttft_s <= 0.002:
            return
        sample = decision.cost_tokens / ttft_s
        self.rate = min(1e6, max(50.0, self.rate + self.alpha * (sample - self.rate)))

    def _observe(self, load: tuple[float, float, float], ttft_s: float) -> None:
        x = (1.0, load[0] / 1000.0, load[1], load[2])  # tokens in thousands: a well-conditioned fit
        keep = 1.0 - 1.0 / self.window
        sums = self._sums
        k = 0
        for i in range(4):
            xi = x[i]
            for j in range(i, 4):
                sums[k] = sums[k] * keep + xi * x[j]
                k += 1
            sums[10 + i] = sums[10 + i] * keep + xi * ttft_s
        self._seen += 1
        if self._seen >= LOAD_MIN_SAMPLES and self._seen % LOAD_REFIT_EVERY == 0:
            self._fit()

    def _fit(self) -> None:
        """Solve the weighted normal equations (a little ridge for conditioning); the slopes' ratios are the
        token prices of a running request and a request ahead."""
        sums = self._sums
        a = [[0.0] * 5 for _ in range(4)]
        k = 0
        for i in range(4):
            for j in range(i, 4):
                a[i][j] = a[j][i] = sums[k]
                k += 1
            a[i][4] = sums[10 + i]
        for i in range(4):
            a[i][i] += 1e-3 * a[i][i] + 1e-9
        theta = _solve(a)
        if theta is None:
            return
        per_ktok = theta[1] if theta[1] > 1e-3 else 1e-3  # s per 1,000 tokens; at most 1M tok/s
        running = 1000.0 * theta[2] / per_ktok
        ahead = 1000.0 * theta[3] / per_ktok
        self.running_tokens = min(LOAD_TOKENS_MAX, max(self.running_floor, running))
        self.request_tokens = min(LOAD_TOKENS_MAX, max(0.0, ahead))


LOAD_MIN_SAMPLES = 64
LOAD_REFIT_EVERY = 16
LOAD_TOKENS_MAX = 8192.0


def _solve(a: list[list[float]]) -> list[float] | None:
    """Gaussian elimination with partial pivoting of the augmented n x (n+1) matrix ``a`` (changed)."""
    n = len(a)
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-12:
            return None
        a[col], a[piv] = a[piv], a[col]
        row = a[col]
        for r in range(col + 1, n):
            f = a[r][col] / row[col]
            if f:
                other = a[r]
                for c in range(col, n + 1):
                    other[c] -= f * row[c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (a[r][n] - sum(a[r][c] * out[c] for c in range(r + 1, n))) / a[r][r]
    return out


def uncached_tokens(index: PrefixIndex, facts: RequestFacts, ep: EndpointSnapshot) -> tuple[float, int]:
    """(prompt tokens ``ep`` would compute, prefix blocks or chunks it holds)."""
    exact = facts.cached_tokens
    if exact is not None:
        cached = exact.get(ep.key)
        if cached is not None:
            uncached = facts.prompt_tokens - cached
            return (uncached if uncached > 0 else 0.0), cached // ep.block_size
    if not facts.prefix_hashes:
        return float(facts.prompt_tokens), 0
    matched = index.match(ep.key, facts.prefix_hashes)
    uncached = facts.prompt_tokens - matched * CHUNK_CHARS / CHARS_PER_TOKEN
    return (uncached if uncached > 0.0 else 0.0), matched


def uncached_all(ctx: Context, memory: PrefixMemory) -> list[tuple[float, int]]:
    """``uncached_tokens`` of every endpoint, once per decision."""
    got = ctx.memo.get("uncached")
    if got is None:
        index, facts = memory.index, ctx.facts
        got = ctx.memo["uncached"] = [uncached_tokens(index, facts, e) for e in ctx.pool]
    return got


@plugin
class Ttft(Scorer):
    """The estimated prefill-token equivalents ahead of and in this request on each endpoint."""

    name = "ttft"
    help = "estimated time to first token: queue ahead + uncached prefill, KV pressure as a penalty"
    uses_prefix_hashes = True
    exact_aware = True

    def __init__(self, env: Env, prefill_tokens_per_s: float | None = None, running_tokens: float = 16.0,
                 kv_threshold: float = 0.8, kv_penalty_tokens: float = 4096.0, learn_alpha: float = 0.1,
                 index_capacity: int = 65536, load_window: int = 256) -> None:
        super().__init__(env)
        self.running_tokens, self.kv_threshold, self.kv_penalty_tokens = (
            running_tokens, kv_threshold, kv_penalty_tokens)
        self.model = env.state(TtftModel, prefill_tokens_per_s=prefill_tokens_per_s, learn_alpha=learn_alpha,
                               running_tokens=running_tokens, load_window=load_window)
        self.memory = env.state(PrefixMemory, capacity=index_capacity)

    def score(self, ctx: Context) -> list[float]:
        """Runs for every endpoint on every request: conditional expressions instead of max() calls."""
        model = self.model
        stale_s, avg, thr = self.stale_s, model.avg_prompt_tokens, self.kv_threshold
        per_running, per_ahead = model.running_tokens, model.request_tokens
        out, ahead = [], []
        for ep, (uncached, _) in zip(ctx.pool, uncached_all(ctx, self.memory), strict=True):
            own_running = ep.inflight - ep.unstarted
            if own_running < 0:
                own_running = 0
            if ep.age_s <= stale_s:  # fresh telemetry
                others_waiting = ep.waiting - ep.unstarted
                if others_waiting < 0.0:
                    others_waiting = 0.0
                running = ep.running if ep.running > own_running else float(own_running)
                over = ep.kv_usage - thr
                over = over / (1.0 - thr) if over > 0.0 and thr < 1.0 else 0.0
            else:
                others_waiting, running, over = 0.0, float(own_running), 0.0
            queued = ep.unstarted_tokens + others_waiting * avg
            ahead.append(queued)
            out.append(queued + running * per_running + uncached + over * self.kv_penalty_tokens
                       + (ep.unstarted + others_waiting) * per_ahead)
        ctx.memo[self] = out
        ctx.memo[QUEUED] = ahead
        return out

    def load(self, ctx: Context, pick: int) -> tuple[float, float, float]:
        """(prefill tokens, running requests, requests ahead) of the estimate on ``ctx.pool[pick]``."""
        ep, model = ctx.pool[pick], self.model
        own_running = max(0, ep.inflight - ep.unstarted)
        if ep.age_s <= self.stale_s:
            others_waiting = max(0.0, ep.waiting - ep.unstarted)
            running = max(ep.running, float(own_running))
        else:
            others_waiting, running = 0.0, float(own_running)
        ahead = ep.unstarted + others_waiting
        total = ctx.memo[self][pick]
        tokens = total - running * model.running_tokens - ahead * model.request_tokens
        return tokens, running, ahead

    def reason(self, ctx: Context, pick: int) -> str:
        if ctx.pool[pick].age_s > self.stale_s:
            return "stale_telemetry"
        held = uncached_all(ctx, self.memory)
        matched = held[pick][1]
        best = max(m for _, m in held)
        if matched and matched == best:
            return "prefix_hit"
        cuts, totals = ctx.memo.get(WAIT_CUT), ctx.totals
        if best and cuts and totals and any(totals[i] - cuts[i] < totals[pick] for i in ctx.kept
                                            if held[i][1] == best):
            return "prefix_wait"  # a holder won with its whole credit (at reuse weight 1): its queue lost it
        return "lowest_ttft"

    def detail(self, ctx: Context, pick: int) -> Detail:
        total, rate = ctx.memo[self][pick], self.model.rate
        uncached, matched = uncached_all(ctx, self.memory)[pick]
        cached = ctx.facts.cached_tokens
        unit = "blocks" if cached is not None and ctx.pool[pick].key in cached else "chunks"
        evicted = ctx.memo.get("evicted")
        evicts = evicted[pick] if evicted else 0.0
        ahead = self.model.request_tokens
        return lambda: (f"est {total / rate * 1000:.1f} ms ({total:.0f} tok at {rate:.0f} tok/s, "
                        f"{uncached:.0f} uncached, {matched} {unit} cached"
                        + (f", evicts ~{evicts:.0f} hot tokens" if evicts else "")
                        + (f", a request ahead ~{ahead:.0f} tok)" if ahead else ")"))

    def annotate(self, ctx: Context, pick: int, decision: Decision) -> None:
        total = ctx.memo[self][pick]
        decision.cost_tokens, decision.predicted_s = total, total / self.model.rate
        if self.model.learn:
            decision.load = self.load(ctx, pick)

    def charge_tokens(self, facts: RequestFacts, ep: EndpointSnapshot) -> float:
        return uncached_tokens(self.memory.index, facts, ep)[0]


@plugin
class Reuse(Scorer):
    """This request's tokens each endpoint would compute again (its prompt less the prefix it holds)."""

    name = "reuse"
    help = ("the request's uncached tokens per endpoint (exact view, else the approximate index); "
            "wait_bound: a pending prefix's credit shrinks by the prefill queued ahead past the least")
    uses_prefix_hashes = True
    exact_aware = True
    claims = False  # it refines the estimate; ttft names the decision
    uses_load = False

    def __init__(self, env: Env, index_capacity: int = 65536, wait_bound: bool = True) -> None:
        super().__init__(env)
        self.wait_bound = wait_bound
        self.memory = env.state(PrefixMemory, capacity=index_capacity)

    def score(self, ctx: Context) -> list[float]:
        held = uncached_all(ctx, self.memory)
        pending = ctx.facts.pending_tokens if self.wait_bound else None
        queued = ctx.memo.get(QUEUED) if pending else None
        if queued is None:  # nothing pending anywhere (or no ttft scorer before it): the uncached tokens
            return [u for u, _ in held]
        return self.bounded(ctx, held, queued, pending)

    def bounded(self, ctx: Context, held: list[tuple[float, int]], queued: list[float],
                pending: dict[str, int]) -> list[float]:
        """Each endpoint's uncached tokens plus the part of its pending prefix (sent there to compute, not
        yet announced by its KV events) that the prefill queued ahead of it eats: the queue's excess over
        the shortest queue among the kept endpoints, when that one is empty (a recompute there starts at
        once). The request computing that prefix is in that queue (it has no first token yet), so a follower
        waits there for its prefill: behind a queue longer by the whole prefix it gets no credit for it, and
        goes where its first token comes sooner. A prefix the events announced (held) keeps its whole
        credit, whatever the queue; with prefills queued everywhere (a saturated fleet) so does a pending
        one (a recompute would wait too, and evict: many-tenant lost 3-6 points of hits at 480-640 req/s)."""
        least = min(queued[i] for i in ctx.kept)
        if least > 0.0:  # no endpoint would start a recompute at once: waiting for the prefix costs no more
            return [u for u, _ in held]
        out, cuts = [], []
        for ep, (u, _), q in zip(ctx.pool, held, queued, strict=True):
            extra = q - least
            part = pending.get(ep.key, 0) if extra > 0.0 else 0
            cut = (extra if extra < part else float(part)) if part else 0.0
            out.append(u + cut)
            cuts.append(cut)
        ctx.memo[WAIT_CUT] = cuts
        return out


@plugin
class Evict(Scorer):
    """Hot prefix tokens of other prompts that computing this request's uncached tokens would evict."""

    name = "evict"
    help = "hot prefix tokens (of other prompts) a placement would evict from the endpoint's KV cache"
    uses_prefix_hashes = True
    exact_aware = True
    claims = False
    uses_load = False

    def __init__(self, env: Env, kv_threshold: float = 0.8, footprint_window: int = 512,
                 index_capacity: int = 65536) -> None:
        super().__init__(env)
        self.kv_threshold = kv_threshold
        self.footprint = env.state(Footprint, window=footprint_window)
        self.memory = env.state(PrefixMemory, capacity=index_capacity)

    def evicted_tokens(self, facts: RequestFacts, ep: EndpointSnapshot, uncached: float,
                       root: int | None) -> float:
        if uncached <= 0.0 or ep.num_blocks <= 0:
            return 0.0
        room = self.kv_threshold * ep.num_blocks * ep.block_size
        over = self.footprint.hot_tokens(ep.key, exclude=root) + facts.prompt_tokens - room
        return 0.0 if over <= 0.0 else (over if over < uncached else uncached)

    def score(self, ctx: Context) -> list[float]:
        facts = ctx.facts
        root = root_of(facts)
        # a prompt routed on its head may not show its prefix's name yet: none of it is cached, so none of it
        # is hot anywhere to leave out of the charge
        if root is None and not facts.chain_partial:
            out = [0.0] * len(ctx.pool)
        else:
            out = [self.evicted_tokens(facts, e, u, root)
                   for e, (u, _) in zip(ctx.pool, uncached_all(ctx, self.memory), strict=True)]
        ctx.memo["evicted"] = out
        return out
