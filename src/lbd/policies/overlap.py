"""The exact prefix overlap scorer: how much of the prompt each endpoint would compute again.

0 when the endpoint holds the whole prompt in its prefix cache, 1 when it holds none of it: exact where the
router follows the endpoint's KV-cache events (``facts.cached_tokens``), else the approximate text-prefix
index of what was sent where. Weighted against a load scorer it trades cache hits for queueing.
"""

from __future__ import annotations

from lbd.policies.plugin import Context, Detail, Env, Scorer
from lbd.policies.prefix import PrefixMemory
from lbd.policies.registry import plugin
from lbd.policies.ttft import uncached_all


@plugin
class PrefixOverlap(Scorer):
    name = "prefix_overlap"
    help = "share of the prompt the endpoint does not hold cached (exact view, else the approximate index)"
    uses_prefix_hashes = True
    exact_aware = True
    uses_load = False

    def __init__(self, env: Env, index_capacity: int = 65536) -> None:
        super().__init__(env)
        self.memory = env.state(PrefixMemory, capacity=index_capacity)

    def score(self, ctx: Context) -> list[float]:
        prompt = ctx.facts.prompt_tokens
        if prompt <= 0:
            return [1.0] * len(ctx.pool)
        return [u / prompt for u, _ in uncached_all(ctx, self.memory)]

    def reason(self, ctx: Context, pick: int) -> str | None:
        prompt = ctx.facts.prompt_tokens
        return "prefix_overlap" if prompt > 0 and uncached_all(ctx, self.memory)[pick][0] < prompt else None

    def detail(self, ctx: Context, pick: int) -> Detail:
        prompt = ctx.facts.prompt_tokens
        held = prompt - uncached_all(ctx, self.memory)[pick][0]
        return f"{held:.0f} of {prompt} prompt tokens cached"
