"""MoE models across DP ranks under `lbd supervise`, on the tiny random MoE checkpoints (Mixtral, Qwen3-MoE,
DeepSeek-V2 with MLA) on 2 CPU cores:

* output tok/s of one rank (DP=1: 2 CPUs, no group) vs DP=2 without expert parallelism (experts split
  tensor-parallel over the group) vs DP=2 + EP (each rank owns half the experts), balanced load (requests
  alternate between the ranks' ports) -- the three nodes run side by side and are measured in interleaved
  rounds (A B C A B C), quoted as medians;
* the fraction of the DP ranks' forward passes that were dummy passes (``lbd_dp_dummy_steps_total`` over
  ``lbd_dp_steps_total`` of every rank, the run's delta) under a skewed load (every request pinned to rank
  0: rank 1 steps only to meet rank 0's collectives) and under the balanced one;
* MLA's KV-cache bytes per token against what plain MHA of the same model would take (the engine's own
  start-up log line), and the same arithmetic for DeepSeek-V2-Lite's real config.

    python benchmarks/moe_dp.py [--requests 16] [--concurrency 4] [--output-tokens 32] [--rounds 2]

Every process started here is stopped before the script exits. The machine is shared: figures are noisy;
compare the rows of one run, never with another day's.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test-support helpers
from support.node import SupervisorNode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from support import (  # noqa: E402
    exit_on_sigterm,
    make_tiny_deepseek_v2,
    make_tiny_mixtral,
    make_tiny_qwen3_moe,
    metric_value,
)

MODELS = {"Mixtral": make_tiny_mixtral, "Qwen3-MoE": make_tiny_qwen3_moe,
          "DeepSeek-V2": make_tiny_deepseek_v2}
# the single rank logs at info: its MLA line (bytes per token against MHA) is read from its log
CONFIGS = {"1 rank": (1, ["--log-level", "info"]), "DP=2": (2, []),
           "DP=2 + EP": (2, ["--enable-expert-parallel"])}
PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "Hello world, how are you"]
_MLA_LINE = re.compile(r"MLA KV cache: (\d+) bytes per token .*would take (\d+)")
# DeepSeek-V2-Lite's attention, from its config.json
LITE = {"layers": 27, "heads": 16, "kv_lora_rank": 512, "rope": 64, "nope": 128, "v": 128}


def run_load(node: SupervisorNode, model: str, args: argparse.Namespace, pin: int | None) -> float:
    """Output tok/s of ``args.requests`` greedy completions, ``args.concurrency`` at a time; each pinned to
    rank ``pin``, or alternating between the ranks."""
    ranks = node.ranks

    def one(i: int) -> int:
        rank = pin if pin is not None else i % ranks
        body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": args.output_tokens,
                "temperature": 0, "ignore_eos": True}
        r = httpx.post(node.rank_url(rank) + "/v1/completions", json=body, timeout=300,
                       headers={"X-data-parallel-rank": str(rank)})
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        tokens = sum(pool.map(one, range(args.requests)))
    return tokens / (time.perf_counter() - t0)


def dp_steps(node: SupervisorNode) -> tuple[float, float]:
    """(dummy, all) forward passes of the group's ranks so far."""
    dummy = steps = 0.0
    for rank in range(node.ranks):
        text = httpx.get(node.rank_url(rank) + "/metrics", timeout=10).text
        dummy += metric_value(text, "lbd_dp_dummy_steps_total")
        steps += metric_value(text, "lbd_dp_steps_total")
    return dummy, steps


def wait_idle(node: SupervisorNode) -> None:
    if node.ranks > 1:
        node.wait_for(lambda: not (node.status()["groups"][0]["wave"] or {}).get("active"), 60, "wave end")


def dummy_fraction(node: SupervisorNode, model: str, args: argparse.Namespace, pin: int | None) -> float:
    wait_idle(node)
    d0, s0 = dp_steps(node)
    run_load(node, model, args, pin)
    wait_idle(node)
    d1, s1 = dp_steps(node)
    return (d1 - d0) / (s1 - s0) if s1 > s0 else float("nan")


def mla_bytes(log: str) -> tuple[int, int] | None:
    m = _MLA_LINE.search(log)
    return (int(m.group(1)), int(m.group(2))) if m else None


def bench_model(name: str, path: Path, args: argparse.Namespace, logs: Path) -> dict[str, object]:
    nodes = {cfg: SupervisorNode(path, size, *flags, "--max-num-seqs", str(args.concurrency),
                                 log=logs / f"{name}-{cfg.replace(' ', '')}.log", interval=1.0, timeout=5.0,
                                 threshold=3)
             for cfg, (size, flags) in CONFIGS.items()}
    try:
        for node in nodes.values():
            node.wait_ready(600)
        model = str(path)
        tok_s: dict[str, list[float]] = {cfg: [] for cfg in nodes}
        run_load(nodes["1 rank"], model, args, None)  # warm-up of every path
        for node in nodes.values():
            run_load(node, model, args, None)
        for _ in range(args.rounds):
            for cfg, node in nodes.items():
                wait_idle(node)
                tok_s[cfg].append(run_load(node, model, args, None))
        dummy = {cfg: (dummy_fraction(node, model, args, 0), dummy_fraction(node, model, args, None))
                 for cfg, node in nodes.items() if node.ranks > 1}
        return {"tok_s": {cfg: statistics.median(v) for cfg, v in tok_s.items()}, "dummy": dummy,
                "mla": mla_bytes(nodes["1 rank"].log_text())}
    finally:
        for node in nodes.values():
            node.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = p.parse_args()
    exit_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="lbd-moe-dp-") as tmp:
        root = Path(tmp)
        results = {}
        for name in args.models:
            path = MODELS[name](root / name)
            results[name] = bench_model(name, path, args, root)
            print(f"{name}: {results[name]}", flush=True)
    print(f"\n{args.requests} greedy requests x {args.output_tokens} tokens, {args.concurrency} in flight, "
          f"medians of {args.rounds} interleaved rounds; 2 CPU cores shared with other engineers' tests\n")
    print("| model | 1 rank tok/s | DP=2 tok/s | DP=2 + EP tok/s | EP / no EP | DP=2+EP / 1 rank | "
          "dummy steps, skewed (DP=2 / +EP) | dummy steps, balanced (DP=2 / +EP) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        t, d = r["tok_s"], r["dummy"]
        print(f"| {name} | {t['1 rank']:.0f} | {t['DP=2']:.0f} | {t['DP=2 + EP']:.0f} | "
              f"{t['DP=2 + EP'] / t['DP=2']:.2f}x | {t['DP=2 + EP'] / t['1 rank']:.2f}x | "
              f"{d['DP=2'][0]:.0%} / {d['DP=2 + EP'][0]:.0%} | "
              f"{d['DP=2'][1]:.0%} / {d['DP=2 + EP'][1]:.0%} |")
    mla = results.get("DeepSeek-V2", {}).get("mla")
    print("\n| MLA KV cache | bytes per token | plain MHA would take | ratio |\n|---|---|---|---|")
    if mla:
        print(f"| tiny DeepSeek-V2 (engine log, fp32) | {mla[0]} | {mla[1]} | {mla[1] / mla[0]:.1f}x |")
    lat = LITE["layers"] * (LITE["kv_lora_rank"] + LITE["rope"]) * 2
    mha = LITE["layers"] * LITE["heads"] * (LITE["nope"] + LITE["rope"] + LITE["v"]) * 2
    print(f"| DeepSeek-V2-Lite (its config, bf16, arithmetic) | {lat} | {mha} | {mha / lat:.1f}x |")


if __name__ == "__main__":
    main()
