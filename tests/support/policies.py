"""Policy test helpers: endpoint snapshots, back-to-back dispatch as the router accounts it, hot prefixes."""

from __future__ import annotations

from dataclasses import replace

from lbd.policies import CHUNK_CHARS, EndpointSnapshot, RequestFacts, chunk_hashes


def eps(n: int, **kw: object) -> list[EndpointSnapshot]:
    """``n`` fresh endpoints http://e0.. with the given snapshot fields."""
    return [EndpointSnapshot(key=f"http://e{i}", rank=i, age_s=0.05, **kw) for i in range(n)]


def dispatch(policy, facts: RequestFacts, endpoints: list[EndpointSnapshot], n: int) -> list[str]:
    """Route ``n`` requests back to back, accounting each dispatch the way the router does between scrapes."""
    keys = []
    for _ in range(n):
        d = policy.choose(facts, endpoints)
        charge = int(policy.charge_tokens(facts, d.endpoint))
        policy.on_dispatch(facts, d.endpoint.key)
        i = endpoints.index(d.endpoint)
        e = endpoints[i]
        endpoints[i] = replace(
            e,
            inflight=e.inflight + 1,
            delta=e.delta + 1,
            unstarted=e.unstarted + 1,
            unstarted_tokens=e.unstarted_tokens + charge,
        )
        keys.append(d.endpoint.key)
    return keys


def hot(n_chunks: int = 8, salt: str = "") -> RequestFacts:
    """Facts of a long system-prompt request (``n_chunks`` prefix chunks); ``salt`` makes another one."""
    text = (salt + "You are a helpful assistant. " * 200)[: CHUNK_CHARS * n_chunks]
    return RequestFacts(prefix_hashes=chunk_hashes(text), prompt_tokens=len(text) // 4)
