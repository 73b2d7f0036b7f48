"""Prefill/decode disaggregation's plugins: the role filter and the prefill rank's scorer.

P/D is two profiles run by ``select.route`` like every other decision (``lbd.router.disagg`` runs them): a
request's prefill stage by the prefill profile (``pd_prefill``: ``prefill_work``, the lowest), its decode
stage by the router's own profile, each behind the router's gate plus a role rule (``stage_gate``), which
refuses (503) when no ready rank has the role, so a stage never lands on a rank of the other role.

- ``role`` (filter): endpoints whose role (``EndpointSnapshot.role``: ``--prefill``/``--decode``, or a
  supervisor's /status) is the one asked for. In a composed profile it is a preference, as every profile
  filter is (none of that role: all kept); in a stage's gate it is a rule.
- ``prefill_work`` (scorer): the prefill work ahead of the prompt's on a rank, least first: the prompt tokens
  of the router's stages there that have no first byte yet (the snapshot's ``unstarted_tokens``, every
  router worker's: a rank busy with one long prefill step reports no queue until the step ends) plus the
  prompt's tokens not cached there (the exact view's ``cached_tokens``); then the scraped backlog (waiting
  requests, fresh telemetry only). It charges a stage the prompt's uncached tokens.
"""

from __future__ import annotations

from lbd.policies.base import EndpointSnapshot, Refusal, RequestFacts
from lbd.policies.filters import GATE
from lbd.policies.plugin import Context, Detail, Env, Filter, Scorer
from lbd.policies.registry import plugin

ROLES = ("prefill", "decode", "mixed")


@plugin
class Role(Filter):
    """Endpoints of one role (a preference in a profile: none of that role keeps them all)."""

    name = "role"
    help = "endpoints of one role: prefill, decode or mixed (P/D: --prefill/--decode or a supervisor's word)"
    uses_load = False

    def __init__(self, env: Env, role: str = "decode") -> None:
        super().__init__(env)
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        self.role = role

    def filter(self, ctx: Context, kept: list[int]) -> list[int] | Refusal:
        pool, role = ctx.pool, self.role
        return [i for i in kept if pool[i].role == role]


class RoleRule(Role):
    """The role as a rule (a stage's gate): none of that role among the gate's survivors is a 503 whose
    reason (``no_prefill_rank``, ``no_decode_rank``) says which."""

    def filter(self, ctx: Context, kept: list[int]) -> list[int] | Refusal:
        out = super().filter(ctx, kept)
        if out:
            return out
        model = ctx.facts.model
        return Refusal(503, f"no ready {self.role} rank serves model {model!r}", f"no_{self.role}_rank")


_ENV = Env()
_GATES = {role: (*GATE, RoleRule(_ENV, role=role)) for role in ("prefill", "decode")}


def stage_gate(role: str) -> tuple[Filter, ...]:
    """The router's gate plus the rule that keeps a P/D stage on ranks of ``role`` (prefill or decode)."""
    return _GATES[role]


def has_role(endpoints: list[EndpointSnapshot], role: str, model: str | None) -> bool:
    """Whether a ready endpoint of ``role`` serves ``model`` (P/D asks before it splits a request)."""
    return any(e.role == role and e.healthy and not e.draining and e.serves(model) for e in endpoints)


@plugin
class PrefillWork(Scorer):
    """Least prefill work ahead: unstarted prompt tokens there plus the prompt's uncached tokens, then the
    scraped backlog (a fraction under 1, so it only breaks ties of whole tokens)."""

    name = "prefill_work"
    help = "P/D's prefill rank: prompt tokens of router stages without a first byte there + the prompt's " \
           "uncached tokens; then the scraped backlog"
    exact_aware = True

    def score(self, ctx: Context) -> list[float]:
        facts, stale_s = ctx.facts, self.stale_s
        cached = facts.cached_tokens or {}
        need = facts.prompt_tokens
        out = []
        for e in ctx.pool:
            backlog = e.waiting if e.fresh(stale_s) else 0.0
            out.append(e.unstarted_tokens + max(0, need - cached.get(e.key, 0)) + backlog / (backlog + 1.0))
        return out

    def reason(self, ctx: Context, pick: int) -> str:
        return "least_prefill_work"

    def detail(self, ctx: Context, pick: int) -> Detail:
        e, facts = ctx.pool[pick], ctx.facts
        cached = (facts.cached_tokens or {}).get(e.key, 0)
        return lambda: (f"ahead {e.unstarted_tokens} tokens, prompt {facts.prompt_tokens} ({cached} cached), "
                        f"waiting {e.waiting:g}")

    def charge_tokens(self, facts: RequestFacts, ep: EndpointSnapshot) -> float:
        return float(max(0, facts.prompt_tokens - (facts.cached_tokens or {}).get(ep.key, 0)))
