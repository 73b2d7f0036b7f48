"""Flow control's flags (``lbd route --flow-*``), checked into ``FlowSettings``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

MODES = ("auto", "on", "off")


@dataclass(slots=True, frozen=True)
class FlowSettings:
    """What ``--flow-*`` set (see ``add_flow_arguments`` for each one's meaning)."""

    mode: str = "auto"  # auto: on once more than one flow (tenant x class) is seen; on; off
    max_prefill_tokens_per_rank: int = 8192
    max_waiting_per_rank: float = 4.0
    max_kv_usage: float = 0.95
    max_queued: int = 1024
    max_queued_per_tenant: int = 256
    max_wait_s: float = 60.0
    poll_s: float = 0.005
    engine_preemption: bool = False
    sheddable_priority: int | None = None  # this class and less important ones (higher numbers) are sheddable

    def sheddable(self, priority: int) -> bool:
        """A request of class ``priority`` is answered 503 at once while the pool is saturated, not held."""
        return self.sheddable_priority is not None and priority >= self.sheddable_priority


def add_flow_arguments(p: argparse.ArgumentParser) -> None:
    d = FlowSettings()
    g = p.add_argument_group("flow control (tenants and priorities: lbd.router.flow)")
    g.add_argument("--flow-control", choices=MODES, default=d.mode,
                   help="hold requests in the router while every endpoint is saturated, strict by priority "
                        "band, fair by tokens per tenant within one; auto: on once more than one tenant or "
                        "priority is seen; off: every request goes straight to decide")
    g.add_argument("--flow-max-prefill-tokens-per-rank", type=int, default=d.max_prefill_tokens_per_rank,
                   help="a rank is saturated while the prompt tokens of the router's requests there that "
                        "have not answered a first byte (its queued prefill, all workers) reach this")
    g.add_argument("--flow-max-waiting-per-rank", type=float, default=d.max_waiting_per_rank,
                   help="... or while its engine reports this many waiting requests (fresh telemetry)")
    g.add_argument("--flow-max-kv-usage", type=float, default=d.max_kv_usage,
                   help="... or while its KV-cache use (fresh telemetry, 0..1) reaches this")
    g.add_argument("--flow-engine-preemption", action=argparse.BooleanOptionalAction,
                   default=d.engine_preemption,
                   help="the ranks run --scheduling-policy priority (a more important request preempts a "
                        "less important one): a request is not held while requests of a less important class "
                        "run, since its engine makes room for it; with FCFS ranks leave it off")
    g.add_argument("--flow-sheddable-priority", type=int, default=d.sheddable_priority, metavar="N",
                   help="requests of class N or a less important one (a number >= N, in vLLM's order: lower "
                        "is more important) are sheddable: while the pool is saturated they are answered 503 "
                        "at once instead of held; default none (a negative class is vLLM's: more urgent)")
    g.add_argument("--flow-max-queued", type=int, default=d.max_queued,
                   help="requests held in the router (all workers, all tenants); one more is answered 429 "
                        "with Retry-After")
    g.add_argument("--flow-max-queued-per-tenant", type=int, default=d.max_queued_per_tenant,
                   help="requests of one tenant held in the router (all workers); one more is answered 429")
    g.add_argument("--flow-max-wait-s", type=float, default=d.max_wait_s,
                   help="a request held this long is answered 503 with Retry-After")
    g.add_argument("--flow-poll-ms", type=float, default=d.poll_s * 1000,
                   help="while requests are held, how often the dispatcher looks at the pool again (it "
                        "also looks whenever one of this worker's requests ends)")


def flow_settings(ns: argparse.Namespace) -> FlowSettings | str:
    """The checked settings, or the problem (one line naming the flag)."""
    for flag, value in (("--flow-max-prefill-tokens-per-rank", ns.flow_max_prefill_tokens_per_rank),
                        ("--flow-max-waiting-per-rank", ns.flow_max_waiting_per_rank),
                        ("--flow-max-queued", ns.flow_max_queued),
                        ("--flow-max-queued-per-tenant", ns.flow_max_queued_per_tenant),
                        ("--flow-max-wait-s", ns.flow_max_wait_s),
                        ("--flow-poll-ms", ns.flow_poll_ms)):
        if not value > 0:
            return f"{flag} must be positive, got {value}"
    if not 0 < ns.flow_max_kv_usage <= 1:
        return f"--flow-max-kv-usage must be in (0, 1], got {ns.flow_max_kv_usage}"
    return FlowSettings(ns.flow_control, ns.flow_max_prefill_tokens_per_rank, ns.flow_max_waiting_per_rank,
                        ns.flow_max_kv_usage, ns.flow_max_queued, ns.flow_max_queued_per_tenant,
                        ns.flow_max_wait_s, ns.flow_poll_ms / 1000, ns.flow_engine_preemption,
                        ns.flow_sheddable_priority)
