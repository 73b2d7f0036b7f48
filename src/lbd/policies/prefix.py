"""An approximate prefix index per endpoint over fixed-size chunks of request text.

The router does not tokenize; it hashes the request text in fixed-size character chunks, each hash chained
on the ones before it, so a chunk hash stands for the whole prefix that ends there. An endpoint's index holds
the chunk hashes of the requests sent to it (bounded, least recently used out first), which approximates the
blocks its prefix cache holds. ``PrefixMemory`` is that index as a profile's learned state: the chunk
hashes of every request dispatched, per endpoint.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from lbd.policies.base import RequestFacts
from lbd.policies.plugin import Learned

CHUNK_CHARS = 128  # ~32 tokens: small enough to catch shared system prompts, big enough to be cheap


def chunk_hashes(text: str | bytes, chunk_chars: int = CHUNK_CHARS, limit: int = 256) -> tuple[int, ...]:
    """Chained 64-bit hashes of the complete ``chunk_chars`` chunks of ``text`` (a partial tail is skipped).

    crc32 and adler32 both continue from a running value, so chaining is free and the result is the same in
    every process (unlike ``hash()``), which lets router workers agree.
    """
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    out: list[int] = []
    c, a = 0, 1
    for start in range(0, min(len(data), chunk_chars * limit) - chunk_chars + 1, chunk_chars):
        piece = data[start : start + chunk_chars]
        c = zlib.crc32(piece, c)
        a = zlib.adler32(piece, a)
        out.append((c << 32) | a)
    return tuple(out)


class PrefixIndex:
    """Chunk hashes per endpoint key, each endpoint bounded to ``capacity`` entries (LRU), and the inverse
    (hash -> the keys holding it), so the endpoints holding a prefix are found without visiting every
    endpoint (``holders``: a fleet's decision samples endpoints and adds those)."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._by_key: dict[str, OrderedDict[int, None]] = {}
        self._keys: dict[int, set[str]] = {}

    def match(self, key: str, hashes: Sequence[int]) -> int:
        """How many leading chunks of ``hashes`` endpoint ``key`` has seen."""
        seen = self._by_key.get(key)
        if not seen:
            return 0
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def insert(self, key: str, hashes: Iterable[int]) -> None:
        seen = self._by_key.get(key)
        if seen is None:
            seen = self._by_key[key] = OrderedDict()
        keys = self._keys
        for h in hashes:
            if h in seen:
                seen.move_to_end(h)
            else:
                seen[h] = None
                holders = keys.get(h)
                if holders is None:
                    keys[h] = {key}
                else:
                    holders.add(key)
        while len(seen) > self.capacity:
            self._drop(seen.popitem(last=False)[0], key)

    def _drop(self, h: int, key: str) -> None:
        holders = self._keys.get(h)
        if holders is not None:
            holders.discard(key)
            if not holders:
                del self._keys[h]

    def holders(self, hashes: Sequence[int]) -> set[str]:
        """The keys holding the longest prefix of ``hashes`` that any endpoint holds (empty: none). A
        chained hash stands for its whole prefix, so the deepest one held is found by bisection."""
        keys = self._keys
        lo, hi = 0, len(hashes)  # hashes[:lo] held by someone; hashes[hi:] by no one
        while lo < hi:
            mid = (lo + hi) // 2
            if hashes[mid] in keys:
                lo = mid + 1
            else:
                hi = mid
        return keys[hashes[lo - 1]] if lo else set()

    def size(self, key: str) -> int:
        return len(self._by_key.get(key, ()))

    def forget(self, key: str) -> None:
        for h in self._by_key.pop(key, ()):
            self._drop(h, key)


class PrefixMemory(Learned):
    """The approximate prefix index a profile learns from its dispatches (shared by its plugins)."""

    __slots__ = ("capacity", "index")

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self.index = PrefixIndex(capacity)

    def on_dispatch(self, facts: RequestFacts, key: str) -> None:
        if facts.prefix_hashes:
            self.index.insert(key, facts.prefix_hashes)

    def forget(self, key: str) -> None:
        self.index.forget(key)

    def reset(self) -> None:
        self.index = PrefixIndex(self.capacity)
