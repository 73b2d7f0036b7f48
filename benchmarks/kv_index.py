"""The router's exact KV index: its memory per block and per endpoint, and how fast events are applied.

- memory: ``tracemalloc`` over an index of ``--endpoints`` endpoints, each publishing ``--blocks`` blocks (in
  chains of 16-block BlockStored events), with blocks unique to each endpoint (the costly case: every key is
  held once) and with every endpoint holding the same chains (keys shared; each engine's own hashes); the
  bytes per endpoint-block and per endpoint with no block, against the index's own estimate
  (``lbd.router.kv.memory.estimate``) where the tree has one;
- ingest, in-process through the feed (``EventFeed.on_live``: decode, sequence check, index update, cap), on
  one core's CPU time:
  - ``mix``: benchmarks/fleet_scale.py's batches (16 one-block BlockStored events, one BlockRemoved of 8);
  - ``stored``: batches of one BlockStored event of ``--chain`` blocks;
  - ``removed``: one BlockRemoved event naming the ``--chain`` blocks the batch before stored;
  - ``cleared``: AllBlocksCleared over ``--chain`` blocks.

    .venv/bin/python benchmarks/kv_index.py [--endpoints 1000] [--blocks 1000] [--chain 512] [--seconds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from lbd.router.kv.feed import EventFeed, Source  # noqa: E402
from lbd.router.kv.index import BlockIndex  # noqa: E402
from lbd.wire.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
)

BS = 16


def _fill(index: BlockIndex, endpoints: int, blocks: int, shared: bool) -> list:
    rng = random.Random(0)
    eps = [index.endpoint() for _ in range(endpoints)]
    chains = blocks // 16
    for e in eps:
        for c in range(chains):
            hashes = [rng.getrandbits(63) for _ in range(16)]  # each engine hashes with its own seed
            tokens = (
                [c * 7 + i for i in range(16 * BS)]
                if shared
                else [rng.randrange(1 << 17) for _ in range(16 * BS)]
            )
            e.stored(hashes, None, tokens, BS)
    return eps


def memory(endpoints: int, blocks: int, shared: bool) -> dict[str, float]:
    """Bytes the index holds (tracemalloc) for ``endpoints`` x ``blocks``, and without any block."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = BlockIndex()
    eps = _fill(index, endpoints, 0, shared)
    empty = tracemalloc.get_traced_memory()[0] - base
    del eps, index
    gc.collect()
    base = tracemalloc.get_traced_memory()[0]
    index = BlockIndex()
    eps = _fill(index, endpoints, blocks, shared)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    entries = sum(len(e) for e in eps)
    out = {
        "endpoints": endpoints,
        "blocks": blocks,
        "shared": shared,
        "entries": entries,
        "bytes": used,
        "per_endpoint": empty / endpoints,
        "per_entry": (used - empty) / max(1, entries),
    }
    try:
        from lbd.router.kv.memory import estimate
    except ImportError:  # a tree from before the estimate
        return out
    out["estimate"] = estimate(index).bytes
    return out


def _payloads(chain: int, rounds: int) -> tuple[list[bytes], list[bytes], list[bytes]]:
    rng = random.Random(1)
    stored, removed, cleared = [], [], []
    for r in range(rounds):
        hashes = [rng.getrandbits(63) for _ in range(chain)]
        tokens = [rng.randrange(1 << 17) for _ in range(chain * BS)]
        stored.append(
            encode_batch(KVEventBatch(float(r), [BlockStored(hashes, None, tokens, BS, None, "GPU", None)]))
        )
        removed.append(encode_batch(KVEventBatch(float(r), [BlockRemoved(hashes, "GPU")])))
    cleared.append(encode_batch(KVEventBatch(0.0, [AllBlocksCleared()])))
    return stored, removed, cleared


def ingest(chain: int, seconds: float, endpoints: int) -> dict[str, float]:
    """Blocks/s for stored, removed and cleared, applied through one feed; the feed's endpoint is the last
    of ``endpoints`` (its bit the widest, as in a big fleet)."""
    stored, removed, cleared = _payloads(chain, 64)

    async def run() -> dict[str, float]:
        index = BlockIndex()
        eps = [index.endpoint() for _ in range(endpoints)]
        feed = EventFeed("bench", Source("tcp://127.0.0.1:1", None), eps[-1])
        feed.stats.state = "live"
        spent = {"stored": 0.0, "removed": 0.0, "cleared": 0.0}
        done = {"stored": 0, "removed": 0, "cleared": 0}
        seq = 0
        clock = time.thread_time
        began = clock()
        while clock() - began < seconds:
            for i in range(len(stored)):
                kind = "removed" if i % 2 else "cleared"
                t0 = clock()
                await feed.on_live(seq, stored[i])
                t1 = clock()
                await feed.on_live(seq + 1, removed[i] if kind == "removed" else cleared[0])
                t2 = clock()
                seq += 2
                spent["stored"] += t1 - t0
                spent[kind] += t2 - t1
                done["stored"] += chain
                done[kind] += chain
        return {k: done[k] / spent[k] for k in spent}

    return asyncio.run(run())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoints", type=int, default=1000)
    p.add_argument("--blocks", type=int, default=1000)
    p.add_argument("--chain", type=int, default=512)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--no-memory", action="store_true")
    args = p.parse_args()
    if not args.no_memory:
        for shared in (False, True):
            m = memory(args.endpoints, args.blocks, shared)
            print(
                f"memory {'shared' if shared else 'unique'}: {m['entries']:,} endpoint-blocks over "
                f"{m['endpoints']} endpoints: {m['bytes'] / 2**20:.1f} MiB; {m['per_entry']:.0f} B per "
                f"endpoint-block, {m['per_endpoint']:.0f} B per empty endpoint"
                + (f"; estimate {m['estimate'] / 2**20:.1f} MiB" if "estimate" in m else ""),
                flush=True,
            )
    from fleet_scale import kv_ingest_rate

    print(f"ingest mix (fleet_scale): {kv_ingest_rate(args.seconds):,.0f} events/s", flush=True)
    for n in (1, args.endpoints):
        r = ingest(args.chain, args.seconds, n)
        print(
            f"ingest, chains of {args.chain}, endpoint bit {n - 1}: "
            + ", ".join(f"{k} {v:,.0f} blocks/s" for k, v in r.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
