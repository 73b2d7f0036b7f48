"""What prefix-cache block keys cost: per block for each --prefix-caching-hash-algo, per 2,000-token prompt,
and where it is paid (when the core takes the request, not inside the step).

Prints, per algorithm: microseconds per 16-token block and for a whole 2,000-token prompt (the best of 50
keyings), and the time of the step's prefix lookup for that prompt once its keys exist (a dict walk that
re-verifies token ids; no hashing). Also the KV-event recorder's cost per stored block.

    .venv/bin/python benchmarks/block_hashing.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lbd.engine.core.kv_cache import KVCacheManager  # noqa: E402
from lbd.engine.core.request import Request  # noqa: E402
from lbd.engine.kv_events.recorder import EventRecorder  # noqa: E402
from lbd.wire.core_messages import SamplingParams  # noqa: E402

BS = 16


def req(tokens: list[int]) -> Request:
    return Request("r", tokens, SamplingParams(), None, 0.0)


def best(fn, repeat: int = 5) -> float:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def main() -> int:
    prompt = [(i * 7919) % 49152 for i in range(2000)]
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n")
    print("| algo | us / block | key a 2,000-token prompt (us) | step's prefix lookup, keys known (us) |")
    print("|---|---:|---:|---:|")
    for algo in ("sha256", "builtin"):
        kv = KVCacheManager(1_000, BS, hash_algo=algo)
        key_prompt = best(lambda: kv.hash_upto(req(prompt), len(prompt) // BS), 50) * 1e6  # noqa: B023
        per_block = key_prompt / (len(prompt) // BS)
        warm = req(prompt)
        kv.hash_upto(warm, len(prompt) // BS)
        assert kv.allocate_for(warm, len(prompt), kv.get_computed_prefix(warm)[0])
        warm.num_computed_tokens = len(prompt)
        kv.cache_blocks(warm)
        again = req(prompt)
        kv.hash_upto(again, len(prompt) // BS)  # what Scheduler.add_request does
        lookup = best(lambda: kv.get_computed_prefix(again)) * 1e6  # noqa: B023
        print(f"| {algo} | {per_block:.2f} | {key_prompt:.0f} | {lookup:.0f} |")
    rec = EventRecorder(BS)
    keys = list(range(125))
    t = best(lambda: rec.stored(keys, None, prompt[: 125 * BS])) / 125 * 1e6
    print(f"\nKV-event recorder: {t:.2f} us per stored block (one BlockStored for a 125-block run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
