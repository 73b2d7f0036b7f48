"""LoRA's cost in lbd's engine (issue 44, acceptance 2, lbd's side): output tokens/s of the default model
(SmolLM2-135M, fp32, CPU) in process, for (a) the base model on a core without --enable-lora, (b) the base
model on a core with --enable-lora (no adapted token: what enabling costs by itself), (c) 4 rank-16 adapters
(all seven projections) mixed evenly, at concurrency 1 and 32. Rounds interleave the three cores.

    .venv/bin/python benchmarks/lora_engine.py [--rounds 3] [--prompt-len 64] [--output-len 64]

Not here yet: vLLM's CPU build serving the same adapters (the acceptance's comparison).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from lbd.engine.config.args import EngineArgs  # noqa: E402
from lbd.engine.core.engine_core import EngineCore  # noqa: E402
from lbd.engine.loader import resolve_model  # noqa: E402
from lbd.wire.core_messages import EngineCoreRequest, SamplingParams  # noqa: E402
from support.lora import ATTENTION, MLP, make_adapter  # noqa: E402

NAMES = ("a0", "a1", "a2", "a3")


def run(core: EngineCore, loras: list[str | None], prompt_len: int, output_len: int, seed: int) -> float:
    """Output tokens/s of one batch: every request at once (concurrency = len(loras))."""
    rng = random.Random(seed)
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, lora in enumerate(loras):
        prompt = [rng.randrange(3, 40000) for _ in range(prompt_len)]
        core.add_request(EngineCoreRequest(f"r{seed}-{i}", prompt, sp, None, 0.0, lora_name=lora))
    t0, tokens = time.perf_counter(), 0
    while core.has_work():
        tokens += sum(len(o.new_token_ids) for o in core.step())
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    model = Path(resolve_model(None))
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    paths = [make_adapter(tmp / n, model, rank=16, alpha=32, seed=i, scale=0.02, targets=ATTENTION + MLP)
             for i, n in enumerate(NAMES)]
    modules = [f"{n}={path}" for n, path in zip(NAMES, paths, strict=True)]
    common = dict(model=str(model), kv_cache_memory_bytes=1 << 30, max_num_seqs=32)
    cores = {"base": EngineCore.from_args(EngineArgs(**common), str(model)),
             "lora on, base": EngineCore.from_args(EngineArgs(**common, enable_lora=True, max_loras=4,
                                                              lora_modules=modules), str(model))}
    cores["4 adapters"] = cores["lora on, base"]
    results: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for c in (1, 32):
            for label, core in cores.items():
                loras = [NAMES[i % 4] if label == "4 adapters" else None for i in range(c)]
                if c == 1 and label == "4 adapters":
                    loras = [NAMES[r % 4]]
                rate = run(core, loras, args.prompt_len, args.output_len, seed=r * 100 + c)
                results.setdefault((label, c), []).append(rate)
                print(f"round {r} c={c:2d} {label:14s} {rate:8.1f} tok/s", flush=True)
    print("\n| case | c=1 tok/s (median) | c=32 tok/s (median) |\n|---|---:|---:|")
    for label in cores:
        med = [sorted(results[(label, c)])[len(results[(label, c)]) // 2] for c in (1, 32)]
        print(f"| {label} | {med[0]:.1f} | {med[1]:.1f} |")


if __name__ == "__main__":
    main()
