"""Batched LoRA on the CPU: the grouped path (``lbd.engine.lora.compute.add_grouped``: two matmuls per adapter
in the step) against torch's gather path (``add_gathered``: A and B gathered per token, two ``torch.bmm``),
median microseconds of one projection's delta, one thread, fp32, SmolLM2-135M's projection shapes with 4 slots
(decodes mix 4 adapters and the base model, interleaved, or ordered by slot as the scheduler sends them under
--enable-lora: one slice per adapter; the prefill is 4 sequences of 64 tokens, one adapter each).

    .venv/bin/python benchmarks/lora_compute.py
"""

from __future__ import annotations

import time

import torch

from lbd.engine.lora import compute
from lbd.engine.lora.slots import make_step

SHAPES = {"qkv 576->960 W64": (576, 960, 64), "gate_up 576->3072 W32": (576, 3072, 32),
          "down 1536->576 W16": (1536, 576, 16)}
CASES = {"1 decode": [(0, 1)], "8 decodes": [(i % 5 - 1, 1) for i in range(8)],
         "32 decodes": [(i % 5 - 1, 1) for i in range(32)],
         "32 decodes by slot": sorted((i % 5 - 1, 1) for i in range(32)),  # as the scheduler orders them
         "4x64 prefill": [(i, 64) for i in range(4)]}


def median_us(fn, n: int = 20) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2] * 1e6


def main() -> None:
    torch.set_num_threads(1)
    print("| projection | tokens | grouped (us) | gathered (us) | gathered / grouped |")
    print("|---|---|---:|---:|---:|")
    for label, (fan_in, fan_out, width) in SHAPES.items():
        for case, seqs in CASES.items():
            step = make_step(seqs, torch.device("cpu"))
            x, y = torch.randn(step.num_tokens, fan_in), torch.zeros(step.num_tokens, fan_out)
            a, b = torch.randn(4, fan_in, width), torch.randn(4, width, fan_out)
            grouped = median_us(lambda y=y, x=x, a=a, b=b, s=step: compute.add_grouped(y, x, a, b, s.groups))
            gathered = median_us(lambda y=y, x=x, a=a, b=b, s=step: compute.add_gathered(y, x, a, b,
                                                                                        s.token_slots))
            print(f"| {label} | {case} | {grouped:.0f} | {gathered:.0f} | {gathered / grouped:.1f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
