"""Adapter-aware placement (issue 44): the ``adapter`` scorer, for requests whose ``model`` is a LoRA adapter.

A rank serves an adapter fastest where it already sits in a device slot, then where it sits in the CPU cache
(a copy into a slot), then where a slot is free (a load from disk), and slowest where a slot must be taken
from another adapter (a load, and that adapter's next request loads it again). The scorer charges each tier
in prefill-token equivalents, the unit of the ``ttft`` scorer it is summed with in ``predicted_ttft``, so a
rank holding the adapter wins until its queue costs more than a load elsewhere, and the exact prefix view and
load still count (they are other scorers of the same sum). A load is priced at the rank's own reported load
time (``LoraView.load_s``) times the profile's prefill rate (``TtftModel``, learned from first bytes) when
both are known, never under ``load_tokens``; taking a slot from another adapter (by a load, or by a copy
from the CPU cache into a rank with no free slot) charges the evicted adapter's next load too, unless the
rank names the adapter it would evict (``LoraView.evicts``: its least recently used idle slot) and another
rank holds that one on device: then its next request goes there and nothing is lost. So where every slot of
the fleet is taken, a load evicts a spare replica before an adapter's only copy (an only copy evicted makes
its next request a load that evicts another: one slot short, the fleet reloads on and on). For the same
reason, while every slot is taken, an adapter's holders after the first in its rendezvous order are charged
``evict_tokens``: a replica serves only while the adapter's first holder is that much busier, and otherwise
goes idle until a load takes its slot (a hot replica is never its rank's least recently used slot).

- **Rendezvous home.** Among ranks of one tier, each adapter prefers its own order of ranks: highest-random-
  weight hashing of (adapter, endpoint key), so a cold adapter goes to the same rank from every router
  worker and every router, and its load concentrates instead of scattering over the fleet. The home bias is
  at most ``home_tokens``: load beyond that moves the request down the adapter's order.
- **Replica cap** (``max_replicas``, ``lbd route --lora-max-replicas``): once that many ranks hold the
  adapter on device, a rank that does not hold it is charged ``cap_tokens`` more, so a popular adapter does
  not take a slot on every rank (evicting every other adapter) unless its holders are far more loaded.
- **Placements not yet seen.** The router learns where an adapter went from telemetry a moment later; until
  then its own recent dispatches of that adapter (``Placements``: the last ``recent`` adapter requests)
  count as a copy in the CPU cache there, so a burst for a cold adapter follows its first request. A rank
  with an exact view (lbd's engines) names the adapters of its running and waiting requests (``busy``: there
  or being read); once two of its telemetry samples came after the dispatch, its view is what counts (a
  dispatch mark outliving an eviction kept sending a rank adapters it no longer held, each one a load that
  evicted the next).

A request for the base model (or any model no rank lists as an adapter) gets zeros: the sum, the pick and the
decider are what they are without this scorer. Ranks report residency in ``EndpointSnapshot.lora``; a vLLM
rank's view names only adapters with requests (``LoraView.exact`` is False), so an idle adapter resident
there scores as a load.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict

from lbd.policies.base import EndpointSnapshot, LoraView, RequestFacts
from lbd.policies.plugin import Context, Detail, Env, Learned, Scorer
from lbd.policies.registry import plugin
from lbd.policies.ttft import TtftModel

TIERS = ("adapter_resident", "adapter_cpu", "adapter_free_slot", "adapter_evict")
_MEMO = "adapter.tiers"  # ctx.memo: (tier per endpoint, holders) of this decision


class Placements(Learned):
    """The endpoints the router sent each adapter's last requests to (the last ``recent`` adapter requests),
    until telemetry shows where the adapter is."""

    __slots__ = ("recent", "sent", "adapters", "seq")

    def __init__(self, recent: int = 32) -> None:
        self.recent = recent
        # (adapter, endpoint key) -> the endpoint's telemetry_seq when it was sent there, oldest first
        self.sent: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.adapters: set[str] = set()  # models some endpoint listed as adapters (the scorer adds them)
        self.seq: dict[str, int] = {}  # endpoint key -> its telemetry_seq at the last adapter decision

    def saw_adapter(self, name: str) -> None:
        if name not in self.adapters:
            if len(self.adapters) >= 65536:
                self.adapters.clear()
            self.adapters.add(name)

    def on_dispatch(self, facts: RequestFacts, key: str) -> None:
        if facts.model not in self.adapters or self.recent <= 0:
            return
        pair = (facts.model, key)
        self.sent[pair] = self.seq.get(key, 0)
        self.sent.move_to_end(pair)
        while len(self.sent) > self.recent:
            self.sent.popitem(last=False)

    def forget(self, key: str) -> None:
        for pair in [p for p in self.sent if p[1] == key]:
            del self.sent[pair]
        self.seq.pop(key, None)

    def reset(self) -> None:
        self.sent.clear()
        self.adapters.clear()
        self.seq.clear()

    def unseen(self, adapter: str, e: EndpointSnapshot) -> bool:
        """Whether ``adapter`` was sent to ``e`` lately and ``e``'s view may not show it yet: a view that
        names only busy adapters (vLLM's) never does; an exact one does after its second sample since."""
        at = self.sent.get((adapter, e.key))
        if at is None:
            return False
        view = e.lora
        return view is None or not view.exact or e.telemetry_seq <= at + 1


def is_adapter(model: str | None, pool: list[EndpointSnapshot]) -> bool:
    """Whether some endpoint lists ``model`` as one of its adapters."""
    if model is None:
        return False
    for e in pool:
        view = e.lora
        if view is not None and model in view.known:
            return True
    return False


def full(pool: list[EndpointSnapshot]) -> bool:
    """Whether every slot of the ranks that report their adapters exactly is taken."""
    views = [e.lora for e in pool if e.lora is not None and e.lora.exact]
    return bool(views) and all(v.free_slots == 0 for v in views)


def on_device(pool: list[EndpointSnapshot]) -> Counter[str]:
    """How many endpoints of ``pool`` hold each adapter in a device slot."""
    copies: Counter[str] = Counter()
    for e in pool:
        if e.lora is not None:
            copies.update(e.lora.device)
    return copies


def hrw_weight(adapter: str, key: str) -> int:
    """The rendezvous weight of ``key`` for ``adapter`` (stable across processes and runs)."""
    digest = hashlib.blake2b(f"{adapter}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def tier(view: LoraView | None, adapter: str, sent: bool) -> int:
    """0 on device, 1 in the CPU cache (or being read there, or just sent there), 2 a free slot, 3 a slot to
    take over."""
    if view is not None and adapter in view.device:
        return 0
    if sent or view is not None and (adapter in view.cpu or adapter in view.busy):
        return 1
    if view is not None and view.free_slots > 0:
        return 2
    return 3


@plugin
class Adapter(Scorer):
    """Adapter requests: device < CPU cache < free slot < evicting slot, a rendezvous home per adapter and a
    cap on its device replicas; zeros for every other request."""

    name = "adapter"
    help = "LoRA adapter requests: ranks holding it on device, then in CPU, then a free slot, then an " \
           "evictable one; a rendezvous home per adapter; --lora-max-replicas caps its device copies"
    uses_load = False

    def __init__(self, env: Env, cpu_tokens: float = 128.0, load_tokens: float = 1024.0,
                 evict_tokens: float = 1024.0, home_tokens: float = 256.0, max_replicas: int = 0,
                 cap_tokens: float = 8192.0, recent: int = 32) -> None:
        super().__init__(env)
        if max_replicas < 0:
            raise ValueError(f"max_replicas must be >= 0 (0: no cap), not {max_replicas}")
        self.costs = (0.0, float(cpu_tokens), float(load_tokens), float(load_tokens) + float(evict_tokens))
        self.home_tokens, self.max_replicas, self.cap_tokens = float(home_tokens), max_replicas, cap_tokens
        self.placements = env.state(Placements, recent=recent)
        self._ttft = env.learned.get(TtftModel)  # the profile's prefill rate, when a ttft scorer learns one

    def score(self, ctx: Context) -> list[float]:
        pool, adapter = ctx.pool, ctx.facts.model
        if not is_adapter(adapter, pool):
            return [0.0] * len(pool)
        placements = self.placements
        placements.saw_adapter(adapter)
        for e in pool:
            placements.seq[e.key] = e.telemetry_seq
        tiers = [tier(e.lora, adapter, placements.unseen(adapter, e)) for e in pool]
        copies = on_device(pool) if 1 in tiers or 3 in tiers else Counter()
        holders = tiers.count(0)
        capped = 0 < self.max_replicas <= holders
        spare = self.costs[3] - self.costs[2] if holders > 1 and full(pool) else 0.0
        order = sorted(range(len(pool)), key=lambda i: hrw_weight(adapter, pool[i].key), reverse=True)
        step = self.home_tokens / max(1, len(pool) - 1)
        first = next((i for i in order if tiers[i] == 0), None)  # the holder a replica is spare to
        out = [0.0] * len(pool)
        for place, i in enumerate(order):
            t = tiers[i]
            extra = (spare if i != first else 0.0) if t == 0 else (self.cap_tokens if capped else 0.0)
            out[i] = self.cost(t, pool[i].lora, copies) + place * step + extra
        ctx.memo[_MEMO] = (tiers, holders, capped)
        return out

    def cost(self, t: int, view: LoraView | None, copies: Counter[str]) -> float:
        """Tier ``t``'s charge on a rank: a load there at its own load time when it reports one; a copy from
        the CPU cache into a rank whose slots are all taken also pays the evicted adapter's next load, unless
        another rank holds that adapter on device (``copies``: device copies per adapter in the pool)."""
        if t == 0 or view is None:
            return self.costs[t]
        known = view.load_s > 0.0 and self._ttft is not None
        load = max(self.costs[2], view.load_s * self._ttft.rate) if known else self.costs[2]
        evicted = max(self.costs[3] - self.costs[2], load) if known else self.costs[3] - self.costs[2]
        if view.evicts and copies[view.evicts] > 1:
            evicted = 0.0  # a spare replica: its requests go to the other copies
        if t == 1:
            return self.costs[1] + (evicted if view.free_slots == 0 else 0.0)
        return load if t == 2 else load + evicted

    def reason(self, ctx: Context, pick: int) -> str | None:
        memo = ctx.memo.get(_MEMO)
        return TIERS[memo[0][pick]] if memo is not None else None

    def detail(self, ctx: Context, pick: int) -> Detail | None:
        memo = ctx.memo.get(_MEMO)
        if memo is None:
            return None
        tiers, holders, capped = memo
        adapter, view = ctx.facts.model, ctx.pool[pick].lora
        free = view.free_slots if view is not None else "?"
        cap = f" (cap {self.max_replicas} reached)" if capped else ""
        return lambda: (f"adapter {adapter}: {TIERS[tiers[pick]]}, {holders} rank(s) hold it on device{cap}, "
                        f"{free} free slot(s) there")
