"""A deterministic random routing trace, and every decision a policy takes on it.

The trace is (request facts, endpoint snapshots, exclusions, pin fallback) per step, with the learning hooks
the router calls after a decision (dispatch, first byte, chain known, forget), seeded per configuration. It
was recorded with the one-block policies (``Policy.choose``) before they became profiles of plugins:
``python tests/policies/replay_trace.py`` writes ``replay_decisions.json``; ``test_replay.py`` replays the
same trace through the pipeline and compares every decision.

Only the public policy API is used (``make_policy``, ``route``, the hooks, ``sample.holder_keys``), so the
same code drives both implementations.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

from lbd.policies import Decision, EndpointSnapshot, Refusal, RequestFacts, make_policy, route
from lbd.policies.sample import holder_keys

FIXTURE = Path(__file__).with_name("replay_decisions.json")
STEPS = 400
SEED = 4242
# (policy, options): every registered policy, and the options that change its path
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("round_robin", {}),
    ("least_load", {}),
    ("least_load", {"stale_s": 0.2}),
    ("p2c", {"seed": 3}),
    ("kv_aware", {}),
    ("kv_aware", {"kv_threshold": 0.5, "kv_weight": 30.0, "kv_full": 0.9}),
    ("prefix_affinity", {}),
    ("prefix_affinity", {"gap_abs": 1.0, "gap_rel": 0.1, "index_capacity": 40}),
    ("session", {}),
    ("session", {"epsilon": 0.0, "vnodes": 8}),
    ("predicted_ttft", {}),
    ("predicted_ttft", {"prefill_tokens_per_s": 2000.0, "stale_s": 0.2}),
    ("predicted_ttft", {"evict_weight": 0.0, "exact_gap_free": False, "gap_abs": 2.0}),
    ("predicted_ttft", {"reuse_weight": 0.5, "footprint_window": 16, "kv_threshold": 0.5}),
]
POOL = [f"http://10.0.0.{i}:8000" for i in range(8)]
AGES = [0.05, 0.05, 0.05, 0.3, 2.0, math.inf]


def _snapshot(rng: random.Random, i: int, quiet: bool) -> EndpointSnapshot:
    """One endpoint; ``quiet``: equal, integer loads (ties, so the pickers' rotation is exercised)."""
    models = rng.choice([frozenset({"m"}), frozenset({"m"}), frozenset({"m"}), frozenset(), frozenset({"x"})])
    ep = EndpointSnapshot(
        key=POOL[i], rank=rng.choice([i, i, i, None]), models=models,
        healthy=rng.random() > 0.08, draining=rng.random() < 0.04,
        block_size=16, num_blocks=rng.choice([0, 16, 64, 400, 4000]), age_s=rng.choice(AGES),
    )
    if quiet:
        ep.age_s = 0.05
        ep.inflight = ep.unstarted = rng.choice([0, 0, 1])
        return ep
    ep.inflight = rng.randint(0, 12)
    ep.delta = rng.randint(-3, 8)
    ep.unstarted = rng.randint(0, min(3, ep.inflight))
    ep.unstarted_tokens = ep.unstarted * rng.choice([0, 100, 700, 3000])
    ep.running = float(rng.randint(0, 20)) if rng.random() < 0.7 else rng.uniform(0, 20)
    ep.waiting = float(rng.randint(0, 4)) if rng.random() < 0.7 else rng.uniform(0, 4)
    ep.kv_usage = rng.choice([0.0, 0.3, 0.6, 0.85, 0.95, 0.99, rng.random()])
    return ep


def _facts(rng: random.Random, keys: list[str]) -> RequestFacts:
    """A request of one of a few system prompts and conversations, so prefixes repeat and grow."""
    system, convo = rng.randrange(6), rng.randrange(4)
    n_sys, n_turn = rng.choice([0, 1, 2, 4, 8]), rng.randint(0, 6)
    hashes = tuple(1_000_003 * system + j for j in range(n_sys)) + tuple(
        10**9 * (convo + 1) + 1_000_003 * system + j for j in range(n_turn))
    prompt = rng.choice([0, len(hashes) * 32 + rng.randint(0, 31), rng.randint(1, 6000)])
    f = RequestFacts(
        model=rng.choice([None, "m", "m", "m", "m", "m", "m", "x", "y"]), prefix_hashes=hashes,
        session_key=rng.choice([None, None, "s0", "s1", "s2", "s3", "s4"]),
        pinned_rank=rng.choice([None] * 24 + [0, 3, 9]), prompt_tokens=prompt,
    )
    if rng.random() < 0.4:
        f.cached_tokens = {k: 16 * rng.randint(0, max(0, prompt // 16)) for k in keys if rng.random() < 0.7}
    if rng.random() < 0.5:
        n = rng.choice([0, 4, 7, 8, 12, 30])
        f.block_keys = {16: [7919 * system + b for b in range(n)]}
        f.chain_partial = rng.random() < 0.15
    return f


def trace(index: int) -> list[dict[str, Any]]:
    """The steps of configuration ``index``: facts, endpoints, exclude, pin fallback and the hooks' inputs."""
    rng = random.Random(SEED * 1000 + index)
    steps = []
    for _ in range(STEPS):
        quiet = rng.random() < 0.3
        chosen = sorted(rng.sample(range(len(POOL)), rng.randint(1, len(POOL))))
        endpoints = [_snapshot(rng, i, quiet) for i in chosen]
        keys = [e.key for e in endpoints]
        steps.append({
            "facts": _facts(rng, keys), "endpoints": endpoints,
            "exclude": rng.sample(keys, min(len(keys), rng.choice([0, 0, 0, 1, 2]))),
            "pin_fallback": rng.random() < 0.5,
            "ttft_s": rng.choice([None, 0.001, rng.uniform(0.003, 2.0), rng.uniform(0.003, 0.2)]),
            "head_blocks": rng.choice([None, None, None, 0, 4, 9]),
            "forget": rng.choice(POOL) if rng.random() < 0.03 else None,
            "holders_seed": rng.randrange(1 << 30) if rng.random() < 0.2 else None,
        })
    return steps


def digest(steps: list[dict[str, Any]]) -> str:
    """A fingerprint of the trace's inputs (the fixture is only valid for the trace it was recorded on). A
    snapshot field added after the recording is left out at its default (``role``, P/D's: every endpoint of
    the trace is ``mixed``; a request's ``pending_tokens``: none pending in the trace; ``lora``: no adapters;
    a request's ``avoid``: nothing to avoid; ``telemetry_seq``, ``tokens_per_s`` and ``offered_tokens_per_s``:
    not counted), so the
    fingerprint is still the recorded trace's."""
    text = repr(steps).replace(", lora=None)", ")").replace(", role='mixed')", ")")
    text = text.replace(", pending_tokens=None", "").replace(", avoid=frozenset()", "")
    text = text.replace(", telemetry_seq=0, tokens_per_s=0.0, offered_tokens_per_s=None", "")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def outcome(d: Decision | Refusal, charge: float | None) -> list[Any]:
    if isinstance(d, Refusal):
        return ["refused", d.status, d.reason, d.message]
    return ["routed", d.endpoint.key, d.reason, d.explain(), d.cost_tokens, d.predicted_s, charge]


def run(index: int) -> tuple[str, list[list[Any]]]:
    """(the trace's digest, every step's outcome) for configuration ``index``."""
    name, options = CONFIGS[index]
    policy = make_policy(name, **options)
    steps = trace(index)
    out: list[list[Any]] = []
    for s in steps:
        f: RequestFacts = s["facts"]
        d = route(policy, f, s["endpoints"], s["exclude"], s["pin_fallback"])
        charge = None
        if isinstance(d, Decision):
            charge = policy.charge_tokens(f, d.endpoint)
            policy.on_dispatch(f, d.endpoint.key)
            if s["head_blocks"] is not None:
                policy.on_chain_known(f, d.endpoint.key, s["head_blocks"])
            if s["ttft_s"] is not None:
                policy.on_first_byte(d, s["ttft_s"])
        row = outcome(d, charge)
        if s["holders_seed"] is not None:
            row.append(sorted(holder_keys(policy, f, limit=3, rng=random.Random(s["holders_seed"]))))
        if s["forget"] is not None:
            policy.forget(s["forget"])
        out.append(row)
    return digest(steps), out


def record(path: Path = FIXTURE) -> None:
    data = []
    for i, (name, options) in enumerate(CONFIGS):
        fp, rows = run(i)
        data.append({"policy": name, "options": options, "trace": fp, "outcomes": rows})
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    record(Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURE)
