"""Hot prefixes per endpoint: which prompt prefixes each endpoint served lately and the KV tokens they take.

predicted_ttft charges a placement for what it would evict. A cold 3,000-token prefix put on an endpoint whose
KV cache is already full of other tenants' hot prefixes pushes some of them out (LRU), and the next request of
each evicted tenant computes its prefix again: a real, later cost that the request's own TTFT does not show.
Where the hot prefixes fit in an endpoint's cache the charge is zero, so it only decides under KV pressure
(then it partitions tenants over the ranks by room: cold prefixes go where room is, a busy holder spills to an
endpoint with room before one without).

Only a prefix sent at least twice counts as hot: a one-off prompt (nothing shares it) costs nothing to evict.
A prefix is named by the key of an early block of the request's chain (``ROOT_BLOCKS`` in: past the chat
template's header, inside the system prompt), with the longest prompt seen for it as its size. "Lately" is
counted in dispatches, not seconds (policies read no clock): a prefix is hot on an endpoint while it was sent
there within the last ``window`` dispatches over all endpoints.
"""

from __future__ import annotations

from lbd.policies.base import RequestFacts
from lbd.policies.plugin import Learned

ROOT_BLOCKS = 8  # the 8th block (tokens 112-127 with 16-token blocks) names a prompt's prefix
ROOT_CHUNKS = 2  # without token blocks (approximate path): the 2nd text chunk


def root_of(facts: RequestFacts) -> int | None:
    """The name of the request's prefix, or None for a prompt too short to have one."""
    if facts.block_keys:
        chain = next(iter(facts.block_keys.values()))
        return chain[ROOT_BLOCKS - 1] if len(chain) >= ROOT_BLOCKS else None
    hashes = facts.prefix_hashes
    return hashes[ROOT_CHUNKS - 1] if len(hashes) >= ROOT_CHUNKS else None


class Footprint(Learned):
    """Per endpoint: prefix -> [tokens, last dispatch tick, dispatches], oldest first, and the token sum of
    those sent more than once. A profile's learned state (the eviction scorer's): dispatches touch it."""

    __slots__ = ("window", "tick", "_roots", "_sums")

    def __init__(self, window: int = 512) -> None:
        self.window = window
        self.tick = 0
        self._roots: dict[str, dict[int, list[int]]] = {}
        self._sums: dict[str, int] = {}

    def on_dispatch(self, facts: RequestFacts, key: str) -> None:
        if facts.prompt_tokens and (root := root_of(facts)) is not None:
            self.touch(key, root, facts.prompt_tokens)

    def on_chain_known(self, facts: RequestFacts, key: str, head_blocks: int) -> None:
        # the prefix is counted once per dispatch: here when the head did not reach its name
        if head_blocks < ROOT_BLOCKS and (root := root_of(facts)) is not None:
            self.touch(key, root, facts.prompt_tokens)

    def reset(self) -> None:
        self.tick = 0
        self._roots.clear()
        self._sums.clear()

    def touch(self, key: str, root: int, tokens: int) -> None:
        self.tick += 1
        roots = self._roots.setdefault(key, {})
        entry = roots.pop(root, None)
        if entry is None:
            entry = [tokens, 0, 0]
        total = self._sums.get(key, 0) - (entry[0] if entry[2] > 1 else 0)
        entry[0] = tokens if tokens > entry[0] else entry[0]
        entry[1] = self.tick
        entry[2] += 1
        self._sums[key] = total + (entry[0] if entry[2] > 1 else 0)
        roots[root] = entry  # re-inserted: newest last

    def _expire(self, key: str) -> dict[int, list[int]]:
        roots = self._roots.get(key)
        if not roots:
            return {}
        oldest = self.tick - self.window
        while roots:
            root, entry = next(iter(roots.items()))
            if entry[1] > oldest:
                break
            del roots[root]
            if entry[2] > 1:
                self._sums[key] -= entry[0]
        return roots

    def hot_tokens(self, key: str, exclude: int | None = None) -> int:
        """KV tokens of the prefixes hot on ``key``, leaving out ``exclude`` (the request's own)."""
        roots = self._expire(key)
        total = self._sums.get(key, 0)
        if exclude is not None:
            own = roots.get(exclude)
            if own is not None and own[2] > 1:
                total -= own[0]
        return total

    def forget(self, key: str) -> None:
        self._roots.pop(key, None)
        self._sums.pop(key, None)
