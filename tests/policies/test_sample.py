"""Bounded decisions (lbd.policies.sample) and the prefix index's inverse (PrefixIndex.holders)."""

from __future__ import annotations

import random

from lbd.policies import RequestFacts, make_policy
from lbd.policies.prefix import PrefixIndex
from lbd.policies.sample import holder_keys, sample_indices


def test_holders_are_the_keys_of_the_deepest_prefix_held() -> None:
    idx = PrefixIndex(capacity=8)
    idx.insert("a", [1, 2, 3])
    idx.insert("b", [1, 2])
    idx.insert("c", [9])
    assert idx.holders([1, 2, 3, 4]) == {"a"}
    assert idx.holders([1, 2, 7]) == {"a", "b"}
    assert idx.holders([5]) == set()
    idx.forget("a")
    assert idx.holders([1, 2, 3, 4]) == {"b"}


def test_eviction_keeps_the_inverse_in_step() -> None:
    idx = PrefixIndex(capacity=2)
    idx.insert("a", [1, 2])
    idx.insert("a", [3])  # evicts 1
    assert idx.holders([1]) == set()
    assert idx.match("a", [2]) == 1 and idx.holders([2]) == {"a"}


def test_holder_keys_take_exact_prefixes_first_then_the_text_index() -> None:
    policy = make_policy("prefix_affinity")
    policy.index.insert("text-holder", [11, 12])
    facts = RequestFacts(prefix_hashes=(11, 12, 13), cached_tokens={"x": 0, "y": 64, "z": 32})
    assert holder_keys(policy, facts, limit=3) == ["y", "z", "text-holder"]
    assert holder_keys(policy, facts, limit=1) == ["y"]
    many = make_policy("prefix_affinity")
    for i in range(50):
        many.index.insert(f"e{i}", [7])
    picked = holder_keys(many, RequestFacts(prefix_hashes=(7,)), limit=5, rng=random.Random(1))
    assert len(set(picked)) == 5


def test_sample_indices_are_distinct_and_bounded() -> None:
    rng = random.Random(0)
    assert list(sample_indices(5, 16, rng)) == [0, 1, 2, 3, 4]
    got = sample_indices(1000, 16, rng)
    assert len(set(got)) == 16 and all(0 <= i < 1000 for i in got)
