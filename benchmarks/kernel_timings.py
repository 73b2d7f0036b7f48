"""Kernel benchmark: Triton vs the torch references on one CUDA device, against the device's own limits.

Prints, for decode attention, achieved GB/s (K/V bytes read) as a fraction of the measured device copy
bandwidth; for prefill attention and the fused MoE block, TFLOP/s as a fraction of the measured bf16 matmul
rate; and for every case the Triton kernel's speed-up over the torch reference. Without CUDA it says so and
exits 0.

    .venv/bin/python benchmarks/kernel_timings.py          # print the table
    .venv/bin/python benchmarks/kernel_timings.py --write benchmarks/RESULTS.md
    .venv/bin/python benchmarks/kernel_timings.py --cpu    # this CPU: torch refs vs lbd.kernels.cpu
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DTYPE = torch.bfloat16


@dataclass(slots=True)
class Row:
    name: str
    shape: str
    triton_ms: float
    torch_ms: float
    amount: float  # bytes (unit "GB/s") or FLOPs (unit "TFLOP/s") per call
    unit: str
    limit: float  # the device's measured rate in the same unit
    matches: bool  # the Triton result agrees with the reference (bf16 tolerance): the timing means something

    def rate(self) -> float:
        return self.amount / (self.triton_ms * 1e-3) / (1e9 if self.unit == "GB/s" else 1e12)


def agree(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a.float(), b.float(), rtol=3e-2, atol=3e-2))


def bench_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200))


def copy_bandwidth_gbs() -> float:
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")  # 256 MiB, far past L2
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3) / 1e9  # read + write


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    b = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    ms = bench_ms(lambda: a @ b)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def _paged(lens: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int = 16):
    """A random paged batch on CUDA (shuffled block ids) plus its metadata."""
    from lbd.kernels.metadata import AttentionMetadata

    n_blocks = [math.ceil(s / block_size) for _, s in lens]
    total = sum(n_blocks)
    perm = torch.randperm(total, device="cuda").to(torch.int32)
    tables = torch.zeros(len(lens), max(n_blocks), dtype=torch.int32, device="cuda")
    used = 0
    for i, nb in enumerate(n_blocks):
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    cache_shape = (total, block_size, kv_heads, head_dim)
    kc = torch.randn(cache_shape, device="cuda", dtype=DTYPE)
    vc = torch.randn(cache_shape, device="cuda", dtype=DTYPE)
    qlens = [q for q, _ in lens]
    q = torch.randn(sum(qlens), heads, head_dim, device="cuda", dtype=DTYPE)
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    nd = sum(1 for ql, _ in lens if ql == 1)
    meta = AttentionMetadata(
        query_start_loc=qsl, seq_lens=torch.tensor([s for _, s in lens], dtype=torch.int32, device="cuda"),
        block_tables=tables, slot_mapping=torch.full((sum(qlens),), -1, dtype=torch.int64, device="cuda"),
        max_query_len=max(qlens), max_seq_len=max(s for _, s in lens), num_decodes=nd, num_decode_tokens=nd,
        query_lens_cpu=qlens, seq_lens_cpu=[s for _, s in lens])
    return q, kc, vc, meta


def decode_row(copy_bw: float, batch: int, ctx: int) -> Row:
    from lbd.kernels import triton_ops as tri
    from lbd.kernels.reference import attention as ref

    heads, kv_heads, d = 32, 8, 128
    q, kc, vc, meta = _paged([(1, ctx)] * batch, heads, kv_heads, d)
    scale = d**-0.5
    ok = agree(tri.paged_attention(q, kc, vc, meta, scale), ref.paged_attention(q, kc, vc, meta, scale))
    t_ms = bench_ms(lambda: tri.paged_attention(q, kc, vc, meta, scale))
    r_ms = bench_ms(lambda: ref.paged_attention(q, kc, vc, meta, scale))
    kv_bytes = 2 * batch * ctx * kv_heads * d * kc.element_size()
    return Row("decode attention", f"{batch} seqs x {ctx} ctx, 32/8 heads, d128", t_ms, r_ms, kv_bytes,
               "GB/s", copy_bw, ok)


def prefill_row(mm_rate: float, n_seqs: int, length: int) -> Row:
    from lbd.kernels import triton_ops as tri
    from lbd.kernels.reference import attention as ref

    heads, kv_heads, d = 32, 8, 128
    q, kc, vc, meta = _paged([(length, length)] * n_seqs, heads, kv_heads, d)
    scale = d**-0.5
    ok = agree(tri.paged_attention(q, kc, vc, meta, scale), ref.paged_attention(q, kc, vc, meta, scale))
    t_ms = bench_ms(lambda: tri.paged_attention(q, kc, vc, meta, scale))
    r_ms = bench_ms(lambda: ref.paged_attention(q, kc, vc, meta, scale))
    flops = n_seqs * heads * 4 * d * length * (length + 1) / 2  # causal QK^T and PV
    return Row("prefill attention", f"{n_seqs} x {length} tokens, 32/8 heads, d128", t_ms, r_ms, flops,
               "TFLOP/s", mm_rate, ok)


def moe_row(mm_rate: float, tokens: int) -> Row:
    from lbd.kernels import triton_ops as tri
    from lbd.kernels.reference import moe as ref

    e, k, d, inter = 64, 8, 2048, 1024
    hidden = torch.randn(tokens, d, device="cuda", dtype=DTYPE)
    w13 = torch.randn(e, 2 * inter, d, device="cuda", dtype=DTYPE) / d**0.5
    w2 = torch.randn(e, d, inter, device="cuda", dtype=DTYPE) / inter**0.5
    logits = torch.randn(tokens, e, device="cuda")
    ok = agree(tri.fused_moe(hidden, w13, w2, logits, k, True),
               ref.fused_moe(hidden, w13, w2, logits, k, True))
    t_ms = bench_ms(lambda: tri.fused_moe(hidden, w13, w2, logits, k, True))
    r_ms = bench_ms(lambda: ref.fused_moe(hidden, w13, w2, logits, k, True))
    flops = tokens * k * 6 * d * inter
    return Row("fused MoE", f"{tokens} tokens, 64 experts top-8, D2048 I1024", t_ms, r_ms, flops, "TFLOP/s",
               mm_rate, ok)


def table(rows: list[Row], device: str, copy_bw: float, mm_rate: float) -> str:
    lines = [f"Device: {device}; measured copy bandwidth {copy_bw:.0f} GB/s, "
             f"bf16 matmul {mm_rate:.0f} TFLOP/s", "",
             "| kernel | shape | Triton ms | torch ms | speed-up | achieved | of device limit | matches |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.shape} | {r.triton_ms:.3f} | {r.torch_ms:.3f} | "
                     f"{r.torch_ms / r.triton_ms:.2f}x | {r.rate():.1f} {r.unit} | "
                     f"{r.rate() / r.limit:.0%} | {'yes' if r.matches else 'NO'} |")
    return "\n".join(lines)


def cpu_ms(fn: Callable[[], object], n: int = 50) -> tuple[float, float]:
    """(min, median) ms: on a shared CPU the minimum is the uncontended cost."""
    import statistics
    import time

    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return min(times), statistics.median(times)


def cpu_references(threads: int, pool: bool = True) -> None:
    """The CPU serving path at SmolLM2-135M's shapes (9/3 heads, d64, hidden 576): the torch references and,
    where one exists, the C kernel of ``lbd.kernels.cpu`` on the same inputs, side by side."""
    from lbd.kernels import cpu
    from lbd.kernels.reference import attention, elementwise, moe, rotary
    from lbd.kernels.rope_cache import build_rope_cache

    torch.set_num_threads(threads)
    c = cpu.library() is not None
    if c and pool:  # as the engine core runs them: the C kernels on their pool (torch keeps its threads here)
        cpu.start_pool(sorted(os.sched_getaffinity(0))[:threads])
    heads, kv_heads, d, hidden = 9, 3, 64, 576
    cases: list[tuple[str, Callable[[], object], Callable[[], object] | None]] = []
    for label, lens in (("decode 32 seqs x 256 ctx", [(1, 256)] * 32),
                        ("decode 64 seqs x 450 ctx", [(1, 450)] * 64),
                        ("prefill 4 x 128 new + 1 x 64 on a 192 prefix", [(128, 128)] * 4 + [(64, 256)])):
        q, kc, vc, meta = _paged_cpu(lens, heads, kv_heads, d)
        ref = partial(attention.paged_attention, q, kc, vc, meta, d**-0.5)
        cases.append((f"paged_attention {label}", ref,
                      partial(cpu.paged_attention, q, kc, vc, meta, d**-0.5) if c else None))
    for rows in (32, 512):
        x, r, w = torch.randn(rows, hidden), torch.randn(rows, hidden), torch.rand(hidden)
        cases.append((f"rms_norm + residual, {rows} x 576", partial(elementwise.rms_norm, x, w, 1e-5, r),
                      partial(cpu.rms_norm, x, w, 1e-5, r) if c else None))
        cos_sin = build_rope_cache(d, 8192, 100000.0, None, torch.float32, "cpu")
        qk = torch.randn(rows, (heads + kv_heads) * d)
        pos = torch.randint(0, 8192, (rows,))
        q_part, k_part = qk[:, :heads * d], qk[:, heads * d:]
        rot_args = (pos, q_part, k_part, cos_sin, d)
        cases.append((f"rotary {rows} tokens", partial(rotary.rotary_embedding, *rot_args),
                      partial(cpu.rotary_neox, *rot_args) if c else None))
        gu = torch.randn(rows, 2 * 1536)
        cases.append((f"silu_and_mul {rows} x 1536", partial(elementwise.silu_and_mul, gu), None))
    cases += linear_cases(hidden, c)
    h, logits = torch.randn(32, hidden), torch.randn(32, 8)
    w13, w2 = torch.randn(8, 2 * 512, hidden) / 24, torch.randn(8, hidden, 512) / 22
    cases.append(("fused_moe 32 tokens, 8 experts top-2, I512",
                  partial(moe.fused_moe, h, w13, w2, logits, 2, True), None))
    print(f"CPU, {threads} thread(s), min / median ms (C kernels {'built' if c else 'NOT built: no cc'}, "
          f"{'on their pool' if cpu.pool_threads() else 'on OpenMP threads'}; load {os.getloadavg()[0]:.1f})")
    print(f"  {'case':55s} {'torch reference':>19} {'C (lbd.kernels.cpu)':>19} {'speed-up':>9}")
    for name, ref, native in cases:
        lo, med = cpu_ms(ref)
        line = f"  {name:55s} {lo:8.3f} / {med:8.3f}"
        if native is not None:
            c_lo, c_med = cpu_ms(native)
            line += f" {c_lo:8.3f} / {c_med:8.3f} {lo / c_lo:8.1f}x"
        print(line)


Case = tuple[str, Callable[[], object], Callable[[], object] | None]


def linear_cases(hidden: int, built: bool) -> list[Case]:
    """SmolLM2's projections at decode and prefill sizes: torch's GEMM (MKL / oneDNN) on the plain weight vs
    the packed kernel on the weight packed once (what the engine does at load), fp32 and, where the CPU has
    AVX-512 BF16, bf16."""
    from lbd.kernels.cpu import packed

    shapes = {"qkv": (960, hidden), "gate_up": (3072, hidden), "down": (hidden, 1536),
              "lm_head": (49152, hidden)}
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        ok = built and packed.supported(dtype)
        for rows in (1, 8, 32, 64, 512):
            for name, (n, k) in shapes.items():
                if name == "lm_head" and rows not in (1, 64):
                    continue
                w, x = torch.randn(n, k).to(dtype), torch.randn(rows, k).to(dtype)
                pw = packed.pack(w) if ok else None
                cases.append((f"linear {name} {rows} x {k} -> {n} {str(dtype)[6:]}",
                              partial(torch.nn.functional.linear, x, w),
                              partial(packed.linear, x, pw) if ok else None))
    return cases


def _paged_cpu(lens: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int = 16):
    from lbd.kernels.metadata import AttentionMetadata

    n_blocks = [math.ceil(s / block_size) for _, s in lens]
    perm = torch.randperm(sum(n_blocks) + 8).to(torch.int32)
    tables = torch.zeros(len(lens), max(n_blocks), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(n_blocks):
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    kc = torch.randn(perm.numel(), block_size, kv_heads, head_dim)
    vc = torch.randn_like(kc)
    qlens = [q for q, _ in lens]
    nd = sum(1 for ql, _ in lens if ql == 1)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32),
        seq_lens=torch.tensor([s for _, s in lens], dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.full((sum(qlens),), -1, dtype=torch.int64), max_query_len=max(qlens),
        max_seq_len=max(s for _, s in lens), num_decodes=nd, num_decode_tokens=nd, query_lens_cpu=qlens,
        seq_lens_cpu=[s for _, s in lens])
    return torch.randn(sum(qlens), heads, head_dim), kc, vc, meta


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="also write the table (markdown) to this file")
    parser.add_argument("--cpu", action="store_true",
                        help="time the torch references and the C kernels on this CPU instead")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for --cpu")
    parser.add_argument("--no-pool", action="store_true",
                        help="--cpu: the C kernels on OpenMP threads, not on their pool (cpu/pool.c)")
    args = parser.parse_args()
    if args.cpu:
        cpu_references(args.threads, pool=not args.no_pool)
        return 0
    if not torch.cuda.is_available():
        print("benchmarks/kernel_timings.py needs a CUDA device; none is visible, so nothing was measured.")
        return 0
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    copy_bw, mm_rate = copy_bandwidth_gbs(), matmul_tflops()
    rows = [decode_row(copy_bw, 64, 2048), decode_row(copy_bw, 8, 8192), decode_row(copy_bw, 256, 512),
            prefill_row(mm_rate, 4, 2048), prefill_row(mm_rate, 1, 8192), moe_row(mm_rate, 64),
            moe_row(mm_rate, 4096)]
    text = table(rows, device, copy_bw, mm_rate)
    print(text)
    if args.write:
        args.write.write_text("# Kernel benchmark (benchmarks/kernel_timings.py)\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
