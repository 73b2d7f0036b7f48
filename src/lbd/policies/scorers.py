"""Load scorers: the queue (vLLM's internal-LB score plus the router's dispatches since the scrape) and KV
pressure (a rank near a full KV cache preempts, so a shorter queue there is worth less)."""

from __future__ import annotations

from lbd.policies.pick import stale_note
from lbd.policies.plugin import Context, Detail, Env, Scorer
from lbd.policies.registry import plugin


@plugin
class Queue(Scorer):
    """``queue_score``: waiting x 4 + running + net dispatches since the scrape; stale: in flight only."""

    name = "queue"
    help = "waiting x 4 + running (vLLM's internal-LB score) + router dispatches since the scrape"

    def __init__(self, env: Env, label: str = "least_load") -> None:
        super().__init__(env)
        self.label = label  # the decision's reason when this scorer decided ("": it names none)
        self.claims = bool(label)

    def score(self, ctx: Context) -> list[float]:
        return ctx.queue()

    def reason(self, ctx: Context, pick: int) -> str | None:
        if not self.label:
            return None
        return self.label if ctx.pool[pick].fresh(self.stale_s) else "stale_telemetry"

    def detail(self, ctx: Context, pick: int) -> Detail:
        scores, ep, stale_s = ctx.queue(), ctx.pool[pick], self.stale_s
        return lambda: f"score {scores[pick]:.0f}, max {max(scores):.0f}{stale_note(ep, stale_s)}"


@plugin
class KvPressure(Scorer):
    """0 up to ``kv_threshold`` KV use, then rising to 1 at full (fresh telemetry only)."""

    name = "kv_pressure"
    help = "KV-cache use past --kv-threshold, 0 to 1 at full (weight it against the queue)"

    def __init__(self, env: Env, kv_threshold: float = 0.8) -> None:
        super().__init__(env)
        self.kv_threshold = kv_threshold

    def pressure(self, ctx: Context, i: int) -> float:
        ep = ctx.pool[i]
        if not ep.fresh(self.stale_s) or ep.kv_usage <= self.kv_threshold:
            return 0.0
        return (ep.kv_usage - self.kv_threshold) / max(1e-9, 1.0 - self.kv_threshold)

    def score(self, ctx: Context) -> list[float]:
        return [self.pressure(ctx, i) for i in range(len(ctx.pool))]

    def reason(self, ctx: Context, pick: int) -> str:
        if self.pressure(ctx, pick) > 0:
            return "kv_pressure"
        return "kv_aware" if ctx.pool[pick].fresh(self.stale_s) else "stale_telemetry"

    def detail(self, ctx: Context, pick: int) -> Detail:
        ep, totals = ctx.pool[pick], ctx.totals
        low = min(totals[i] for i in ctx.kept) if totals else 0.0
        return f"kv {ep.kv_usage:.2f}, score {low:.1f}{stale_note(ep, self.stale_s)}"
