"""The ``adapter`` scorer (issue 44): residency tiers, the rendezvous home, the replica cap, placements not
yet seen in telemetry, load still counted, and base-model decisions untouched. Pure and fast: no processes."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from lbd.policies import EndpointSnapshot, RequestFacts, make_policy
from lbd.policies.adapters import hrw_weight
from lbd.policies.base import LoraView

ADAPTERS = frozenset(f"lora{i}" for i in range(32))


def _ep(i: int, device: tuple[str, ...] = (), cpu: tuple[str, ...] = (), free: int = 0, waiting: float = 0.0,
        lora: bool = True, load_s: float = 0.0, evicts: str | None = None,
        busy: tuple[str, ...] = ()) -> EndpointSnapshot:
    view = LoraView(device=frozenset(device), cpu=frozenset(cpu), free_slots=free, max_loras=4,
                    known=ADAPTERS, load_s=load_s, evicts=evicts, busy=frozenset(busy)) if lora else None
    return EndpointSnapshot(key=f"http://r{i}", rank=i, age_s=0.0, num_blocks=1000, waiting=waiting,
                            lora=view)


def _facts(model: str) -> RequestFacts:
    return RequestFacts(model=model, prompt_tokens=200)


def test_tiers_device_then_cpu_then_free_slot_then_eviction() -> None:
    p = make_policy("predicted_ttft", prefill_tokens_per_s=4000.0)
    pool = [_ep(0, device=("x",)), _ep(1, cpu=("lora3",), free=1), _ep(2, free=1), _ep(3, device=("lora3",))]
    expected = [(3, "adapter_resident"), (1, "adapter_cpu"), (2, "adapter_free_slot")]
    for rank, reason in expected:  # (the last one left is the only choice: no plugin decided it)
        d = p.choose(_facts("lora3"), pool)
        assert (d.endpoint.rank, d.reason, d.plugin) == (rank, reason, "adapter"), d.line()
        assert "adapter lora3" in d.explain()
        pool = [e for e in pool if e.rank != rank]


def test_a_copy_into_full_slots_pays_for_the_adapter_it_evicts() -> None:
    """A copy from the CPU cache into a rank with every slot taken evicts an adapter whose next request loads
    it again: a rank with the adapter in CPU and a free slot wins, whichever of the two is the adapter's
    rendezvous home."""
    p = make_policy("predicted_ttft", prefill_tokens_per_s=4000.0)
    for roomy in (1, 2):
        pool = [_ep(i, cpu=("lora3",), free=1 if i == roomy else 0) for i in (1, 2)]
        d = p.choose(_facts("lora3"), pool)
        assert (d.endpoint.rank, d.reason) == (roomy, "adapter_cpu"), d.line()


def test_a_cold_adapter_has_one_home_whatever_the_order_and_adapters_spread() -> None:
    p = make_policy("predicted_ttft", prefill_tokens_per_s=4000.0)
    pool = [_ep(i, free=4) for i in range(8)]
    homes = Counter()
    for name in sorted(ADAPTERS):
        picks = set()
        for seed in range(3):
            shuffled = pool[:]
            random.Random(seed).shuffle(shuffled)
            picks.add(p.choose(_facts(name), shuffled).endpoint.key)
        assert picks == {max((e.key for e in pool), key=lambda k: hrw_weight(name, k))}
        homes[picks.pop()] += 1
    assert len(homes) >= 6, homes  # 32 adapters over 8 ranks: not piled on one


def test_load_still_counts_a_busy_holder_loses_to_an_idle_free_slot() -> None:
    p = make_policy("predicted_ttft", prefill_tokens_per_s=4000.0)
    busy = [_ep(0, device=("lora1",), waiting=40.0), _ep(1, free=2)]
    assert p.choose(_facts("lora1"), busy).endpoint.rank == 1
    light = [_ep(0, device=("lora1",), waiting=1.0), _ep(1, free=2)]
    assert p.choose(_facts("lora1"), light).endpoint.rank == 0


def test_a_load_is_priced_at_the_rank_s_reported_load_time() -> None:
    p = make_policy("predicted_ttft", prefill_tokens_per_s=4000.0)
    holder = _ep(0, device=("lora2",))
    holder.unstarted, holder.unstarted_tokens = 1, 3000  # 0.75 s of prefill queued at 4000 tokens/s
    assert p.choose(_facts("lora2"), [holder, _ep(1, free=2)]).endpoint.rank == 1  # unknown: 1024 tokens
    slow = p.choose(_facts("lora2"), [holder, _ep(1, free=2, load_s=1.0)])  # a load there: 1 s = 4000
    assert (slow.endpoint.rank, slow.reason) == (0, "adapter_resident")


def test_the_replica_cap_keeps_a_popular_adapter_on_its_holders() -> None:
    pool = [_ep(0, device=("lora5",)), _ep(1, device=("lora5",)), _ep(2, free=1), _ep(3, device=("lora6",))]
    for e in pool[:2]:  # the holders have the router's own prefills queued: a load elsewhere is sooner
        e.unstarted, e.unstarted_tokens = 1, 2000
    free = make_policy("predicted_ttft", prefill_tokens_per_s=4000.0)
    assert free.choose(_facts("lora5"), pool).endpoint.rank == 2  # a third copy: the holders are busier
    capped = make_policy("predicted_ttft", prefill_tokens_per_s=4000.0, lora_max_replicas=2)
    d = capped.choose(_facts("lora5"), pool)
    assert d.endpoint.rank in (0, 1) and "cap 2 reached" in d.explain()
    with pytest.raises(ValueError, match="max_replicas"):
        make_policy("predicted_ttft", lora_max_replicas=-1)


def test_a_placement_the_telemetry_has_not_shown_yet_is_followed() -> None:
    p = make_policy("predicted_ttft", prefill_tokens_per_s=4000.0)
    pool = [_ep(i, free=4) for i in range(4)]
    home = max(pool, key=lambda e: hrw_weight("lora7", e.key))
    other = next(e for e in pool if e is not home)
    assert p.choose(_facts("lora7"), pool).endpoint.key == home.key
    p.on_dispatch(_facts("lora7"), other.key)  # e.g. a retry sent it elsewhere; it is loading there now
    d = p.choose(_facts("lora7"), pool)
    assert (d.endpoint.key, d.reason) == (other.key, "adapter_cpu")
    p.forget(other.key)
    assert p.choose(_facts("lora7"), pool).endpoint.key == home.key


def test_a_dispatch_mark_yields_to_a_newer_exact_view() -> None:
    """lbd's ranks report every resident adapter: once two samples came after the dispatch (the first may
    have left before the request arrived), a rank that no longer shows the adapter does not hold it; an
    adapter being read there (a waiting request names it) still counts as on its way."""
    p = make_policy("predicted_ttft", prefill_tokens_per_s=4000.0)
    pool = [_ep(i, free=1) for i in range(4)]
    home = max(pool, key=lambda e: hrw_weight("lora7", e.key))
    other = next(e for e in pool if e is not home)
    p.choose(_facts("lora7"), pool)
    p.on_dispatch(_facts("lora7"), other.key)
    other.telemetry_seq += 1
    assert p.choose(_facts("lora7"), pool).endpoint.key == other.key  # one sample since: maybe older
    other.telemetry_seq += 1
    assert p.choose(_facts("lora7"), pool).endpoint.key == home.key  # it does not show lora7: gone
    other.lora = replace(other.lora, busy=frozenset({"lora7"}))
    d = p.choose(_facts("lora7"), pool)
    assert (d.endpoint.key, d.reason) == (other.key, "adapter_cpu")  # being read there


def test_a_load_into_a_full_fleet_evicts_a_spare_replica_before_an_only_copy() -> None:
    """Every slot is taken: the rank whose next eviction is a replica held elsewhere wins, wherever the cold
    adapter's rendezvous home is; where no rank names its victim, the home wins as before."""
    for home_first in (True, False):
        pool = [_ep(0, device=("lora1", "lora2"), evicts="lora2"), _ep(1, device=("lora1", "lora3"),
                evicts="lora1"), _ep(2, device=("lora4", "lora5"), evicts="lora5")]
        names = sorted(ADAPTERS - {"lora1", "lora2", "lora3", "lora4", "lora5"})
        cold = next(n for n in names if (max(pool, key=lambda e: hrw_weight(n, e.key)).rank == 1) !=
                    home_first)
        p = make_policy("predicted_ttft", prefill_tokens_per_s=4000.0)
        d = p.choose(_facts(cold), pool)
        assert (d.endpoint.rank, d.reason) == (1, "adapter_evict"), d.line()
        blind = [replace(e, lora=replace(e.lora, evicts=None)) for e in pool]
        home = max(blind, key=lambda e: hrw_weight(cold, e.key))
        assert p.choose(_facts(cold), blind).endpoint.rank == home.rank


def test_a_spare_replica_in_a_full_fleet_serves_only_when_the_home_is_much_busier() -> None:
    """Every slot taken: a second holder of the adapter is charged a slot's worth, so a little queue at the
    adapter's first holder keeps its requests there (the replica goes idle, and a load takes its slot); with
    a free slot anywhere, the less loaded holder wins as before."""
    p = make_policy("predicted_ttft", prefill_tokens_per_s=4000.0)
    pool = [_ep(i, device=("lora5", f"x{i}")) for i in range(3)]
    home, spare = sorted(pool[:2], key=lambda e: hrw_weight("lora5", e.key), reverse=True)
    home.unstarted, home.unstarted_tokens = 1, 400  # 0.1 s of prefill queued there
    assert p.choose(_facts("lora5"), pool).endpoint.key == home.key
    pool[2].lora = replace(pool[2].lora, free_slots=1)
    assert p.choose(_facts("lora5"), pool).endpoint.key == spare.key
    pool[2].lora = replace(pool[2].lora, free_slots=0)
    home.unstarted_tokens = 8000  # 2 s: the replica earns its slot
    assert p.choose(_facts("lora5"), pool).endpoint.key == spare.key


def test_base_model_decisions_are_the_same_with_and_without_the_scorer() -> None:
    rng = random.Random(7)
    with_it = make_policy("predicted_ttft", prefill_tokens_per_s=4000.0)
    without = make_policy("predicted_ttft", prefill_tokens_per_s=4000.0, adapter_weight=0.0)
    for step in range(300):
        pool = [_ep(i, device=tuple(rng.sample(sorted(ADAPTERS), 2)), free=rng.randint(0, 2),
                    waiting=float(rng.randint(0, 5)), lora=rng.random() < 0.8) for i in range(6)]
        facts = RequestFacts(model=rng.choice(["base", None]), prompt_tokens=rng.randint(10, 3000),
                             prefix_hashes=tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 4))))
        a, b = with_it.choose(facts, pool), without.choose(facts, pool)
        assert (a.endpoint.key, a.reason, a.plugin) == (b.endpoint.key, b.reason, b.plugin), step
        with_it.on_dispatch(facts, a.endpoint.key)
        without.on_dispatch(facts, b.endpoint.key)
