"""The CPU paged decode attention kernel against the same kernel built from another git revision, cold caches.

One "step" is a decode step's attention over every layer of SmolLM2-135M (9 heads, 3 kv heads, head size 64):
each layer has its own K/V caches and the sequences' blocks are shuffled over them, as in a cache that has
served a while, so the K/V rows come from memory, not from the CPU's caches (``--hot`` points every sequence
at the same few blocks instead: the kernel's arithmetic alone). Both builds run in this process, interleaved
(A B B A ...), on the kernels' thread pool over the CPUs this process may use; outputs must agree.

    .venv/bin/python benchmarks/cpu_decode_attention.py --against HEAD~1 [--batch 64] [--context 190]
        [--block-size 16] [--layers 30] [--rounds 9] [--hot]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lbd.kernels.cpu import build  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def build_at(rev: str, out: Path) -> ctypes.CDLL:
    """The CPU kernels as they were at ``rev`` (their sources from git), loaded with today's signatures."""
    src = out / "src"
    src.mkdir()
    sources = []  # today's C files that ``rev`` already had (an older one lacks e.g. decoder.c)
    for p in [*build._SOURCES, *build._HEADERS]:
        rel = p.relative_to(ROOT).as_posix()
        shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{rel}"], capture_output=True)
        if shown.returncode != 0:  # a revision from before the src layout
            old = rel.removeprefix("src/lbd/")
            shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{old}"], capture_output=True)
        if shown.returncode != 0:
            if p.name == "paged_decode.c":  # not a revision of this kernel at all (or not one git knows)
                raise subprocess.CalledProcessError(shown.returncode, "git show", stderr=shown.stderr)
            continue
        (src / p.name).write_bytes(shown.stdout)
        if p in build._SOURCES:
            sources.append(str(src / p.name))
    so = out / "other.so"
    subprocess.run(["cc", *build._FLAGS, "-o", str(so), *sources, "-lm"], check=True)
    return build.bind(ctypes.CDLL(str(so)), strict=False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True, help="git revision whose kernel is the other side")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=190, help="mean tokens per sequence (+-40)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--hot", action="store_true", help="all sequences read the same blocks (no memory stalls)")
    args = p.parse_args()
    here = build.library()
    if here is None:
        print("the CPU kernels did not build here", file=sys.stderr)
        return 1
    if args.batch < 1 or args.context < 1 or args.layers < 1 or args.rounds < 1 or args.block_size < 1:
        p.error("--batch, --context, --layers, --rounds and --block-size must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            other = build_at(args.against, Path(tmp))
        except subprocess.CalledProcessError as e:
            print(f"--against {args.against}: could not take or build its kernels "
                  f"({(e.stderr or b'').decode(errors='replace').strip()[:300]})", file=sys.stderr)
            return 2
        libs = {"this tree": here, args.against: other}
        cpus = sorted(os.sched_getaffinity(0))
        arr = (ctypes.c_int * len(cpus))(*cpus)
        for lib in libs.values():
            if lib.lbd_pool_start(arr, len(cpus)) != 0:
                print("could not start the kernels' thread pool", file=sys.stderr)
                return 1
        torch.set_num_threads(1)
        rng = random.Random(0)
        bs, b = args.block_size, args.batch
        lens = [max(1, args.context + rng.randrange(-40, 40)) for _ in range(b)]
        per_seq = [(n + bs - 1) // bs for n in lens]
        blocks = sum(per_seq) + 8
        caches = [(torch.randn(blocks, bs, KV_HEADS, HEAD_DIM), torch.randn(blocks, bs, KV_HEADS, HEAD_DIM))
                  for _ in range(args.layers)]
        ids = list(range(blocks))
        rng.shuffle(ids)
        table = torch.zeros(b, max(per_seq), dtype=torch.int32)
        it = iter(ids)
        for s, n in enumerate(per_seq):
            for j in range(n):
                table[s, j] = j if args.hot else next(it)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        q = torch.randn(b, HEADS, HEAD_DIM)
        outs = {name: torch.empty(b, HEADS, HEAD_DIM) for name in libs}
        times: dict[str, list[float]] = {name: [] for name in libs}
        order = list(libs.items())
        for r in range(args.rounds):
            for name, lib in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                for kc, vc in caches:
                    row = HEADS * HEAD_DIM
                    lib.lbd_paged_decode_f32(q.data_ptr(), row, kc.data_ptr(), vc.data_ptr(),
                                             table.data_ptr(), table.shape[1], seq_lens.data_ptr(),
                                             outs[name].data_ptr(), row, HEADS, KV_HEADS, HEAD_DIM, bs,
                                             HEAD_DIM**-0.5, b, max(lens))
                times[name].append(time.perf_counter() - t0)
        first = outs["this tree"]
        if not all(torch.allclose(o, first, atol=1e-5) for o in outs.values()):
            print("the two kernels disagree", file=sys.stderr)
            return 1
        kv = sum(lens) * KV_HEADS * HEAD_DIM * 4 * 2 * args.layers
        print(f"{b} sequences of ~{args.context} tokens, {args.layers} layers, {bs}-token blocks, "
              f"{'hot' if args.hot else 'cold'} caches, {kv / 1e6:.0f} MB of K/V, {len(cpus)} CPUs")
        med = {name: statistics.median(t) for name, t in times.items()}
        for name, t in times.items():
            print(f"  {name:>12}: {med[name] * 1e3:7.2f} ms per step (min {min(t) * 1e3:.2f}), "
                  f"{kv / med[name] / 1e9:5.1f} GB/s")
        ratios = [a / b_ for a, b_ in zip(times["this tree"], times[args.against], strict=True)]
        print(f"  this tree / {args.against}: {statistics.median(ratios):.3f} (median of round pairs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
