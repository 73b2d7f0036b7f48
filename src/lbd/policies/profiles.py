"""The built-in policies, each a profile of registered plugins (``--policy NAME``).

Each builder takes the policy's options as before (``make_policy("kv_aware", kv_weight=100)``) and ignores
the ones it does not use (the router passes every policy the same settings).
"""

from __future__ import annotations

from typing import Any

from lbd.policies.adapters import Adapter
from lbd.policies.affinity import LongestPrefix, Session, SessionCap
from lbd.policies.filters import KvRoom, LoadGap
from lbd.policies.pick import Lowest, PowerOfTwo, RoundRobin
from lbd.policies.plugin import Env, Scorer
from lbd.policies.profile import Profile
from lbd.policies.registry import available, profile
from lbd.policies.roles import PrefillWork
from lbd.policies.scorers import KvPressure, Queue
from lbd.policies.ttft import Evict, Reuse, Ttft


def _profile(name: str, env: Env, filters: list, scorers: list[tuple[Scorer, float]], picker: Any) -> Profile:
    return Profile(name, env, filters, scorers, picker, available()[name])


@profile("round_robin", "each endpoint in turn, ignoring load")
def round_robin(stale_s: float = 1.0, seed: int = 0, **_: Any) -> Profile:
    env = Env(stale_s, seed)
    return _profile("round_robin", env, [], [], RoundRobin(env))


@profile("least_load",
         "lowest waiting x 4 + running (vLLM's internal-LB score) + router dispatches since the scrape")
def least_load(stale_s: float = 1.0, seed: int = 0, **_: Any) -> Profile:
    env = Env(stale_s, seed)
    return _profile("least_load", env, [], [(Queue(env), 1.0)], Lowest(env))


@profile("p2c", "two endpoints at random, the less loaded of them")
def p2c(stale_s: float = 1.0, seed: int = 0, **_: Any) -> Profile:
    env = Env(stale_s, seed)
    return _profile("p2c", env, [], [(Queue(env), 1.0)], PowerOfTwo(env))


@profile("kv_aware", "queue score plus a KV-cache pressure penalty above --kv-threshold; near-full ranks "
         "avoided")
def kv_aware(stale_s: float = 1.0, seed: int = 0, kv_threshold: float = 0.8, kv_weight: float = 8.0,
             kv_full: float = 0.98, **_: Any) -> Profile:
    env = Env(stale_s, seed)
    scorers = [(KvPressure(env, kv_threshold=kv_threshold), kv_weight), (Queue(env, label=""), 1.0)]
    return _profile("kv_aware", env, [KvRoom(env, kv_full=kv_full)], scorers, Lowest(env))


@profile("prefix_affinity",
         "endpoint holding the longest prefix of the request (bounded by a load gap); cold requests spread")
def prefix_affinity(stale_s: float = 1.0, seed: int = 0, gap_abs: float = 4.0, gap_rel: float = 0.5,
                    index_capacity: int = 65536, **_: Any) -> Profile:
    env = Env(stale_s, seed)
    holders = LongestPrefix(env, gap_abs=gap_abs, gap_rel=gap_rel, index_capacity=index_capacity)
    return _profile("prefix_affinity", env, [holders], [(Queue(env), 1.0)], Lowest(env))


@profile("session", "consistent hashing on the session header with bounded load; no session key: least load")
def session(stale_s: float = 1.0, seed: int = 0, epsilon: float = 0.25, vnodes: int = 64,
            **_: Any) -> Profile:
    env = Env(stale_s, seed)
    return _profile("session", env, [SessionCap(env, epsilon=epsilon)], [(Session(env, vnodes=vnodes), 1.0)],
                    Lowest(env))


@profile("predicted_ttft",
         "lowest estimated time to first token: queue ahead + uncached prefill, KV pressure as a penalty")
def predicted_ttft(stale_s: float = 1.0, seed: int = 0, prefill_tokens_per_s: float | None = None,
                   running_tokens: float = 16.0, kv_threshold: float = 0.8, kv_penalty_tokens: float = 4096.0,
                   gap_abs: float = 8.0, gap_rel: float = 0.5, index_capacity: int = 65536,
                   learn_alpha: float = 0.1, reuse_weight: float = 1.0, exact_gap_free: bool = True,
                   evict_weight: float = 1.0, footprint_window: int = 512, adapter_weight: float = 1.0,
                   lora_max_replicas: int = 0, **_: Any) -> Profile:
    """Bounded stickiness: approximate endpoints whose queue score is past the least one by a gap are not
    considered, so a guessed prefix never outweighs a large load gap; endpoints with an exact view are exempt
    (their estimate holds the queue ahead and the true cost of a miss). Equal estimates rotate. LoRA adapter
    requests add the ``adapter`` scorer's residency cost (zeros for the base model: its decisions are the
    same with it)."""
    env = Env(stale_s, seed)
    gap = LoadGap(env, gap_abs=gap_abs, gap_rel=gap_rel, exact_exempt=exact_gap_free)
    scorers: list[tuple[Scorer, float]] = [
        (Ttft(env, prefill_tokens_per_s=prefill_tokens_per_s, running_tokens=running_tokens,
              kv_threshold=kv_threshold, kv_penalty_tokens=kv_penalty_tokens, learn_alpha=learn_alpha,
              index_capacity=index_capacity), 1.0),
        (Reuse(env, index_capacity=index_capacity), reuse_weight),
    ]
    if evict_weight > 0.0:
        scorers.append((Evict(env, kv_threshold=kv_threshold, footprint_window=footprint_window,
                              index_capacity=index_capacity), evict_weight))
    if adapter_weight > 0.0:
        scorers.append((Adapter(env, max_replicas=lora_max_replicas), adapter_weight))
    return _profile("predicted_ttft", env, [gap], scorers, Lowest(env, eps=1e-6))


@profile("pd_prefill", "P/D's prefill stage: the least prefill work ahead (router stages without a first "
         "byte there + the prompt's uncached tokens), then the scraped backlog")
def pd_prefill(stale_s: float = 1.0, seed: int = 0, **_: Any) -> Profile:
    """The profile ``lbd.router.disagg`` runs a prefill stage by (behind the prefill role's gate)."""
    env = Env(stale_s, seed)
    return _profile("pd_prefill", env, [], [(PrefillWork(env), 1.0)], Lowest(env))
