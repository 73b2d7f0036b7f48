"""Tensor and pipeline parallelism inside one rank: output tok/s, step time, collective share, PP bubble.

Every configuration in one run: the engines live side by side in this process (with TP x PP > 1 the rank's
workers are real processes, gloo on the CPU, NCCL on CUDA) and are measured in interleaved rounds (A B C A B
C ...), quoted as medians, on the same requests.

  CPU, the default model SmolLM2-135M (9 heads, 3 KV heads): TP=1 (2 threads), PP=2 (1 thread per
      stage), TP=3 (the model's only TP > 1; 3 workers on 2 cores are oversubscribed)
  CPU, a SmolLM2-shaped random Llama (hidden 576, MLP 1536, 30 layers, vocabulary 49152, tied embeddings;
      12 heads of 48 and 4 KV heads, since SmolLM2's 9 heads do not split in two): TP=1 (2 threads),
      TP=2 (1 thread each; also with gloo's all-reduce instead of shared memory), TP=2 x PP=2 (4 workers on
      2 cores)
  CUDA (when present): the same models for what the visible GPUs allow (TP=1 on one; TP=2, PP=2 on two...)

Columns: output tok/s of N concurrent greedy requests (prompt P tokens, O new tokens, ignore_eos); CPU: the
CPU time of the rank's processes (core and workers) per output token, which a loaded, shared machine distorts
far less than wall time (spin-waiting in a collective counts); step: the
median wall time between two collected batches once every request is decoding; coll: the share of the
workers' busy time spent in TP collectives (all-reduce, logits gather); idle: the share of wall time a
worker is not working on a batch -- for PP rows that is the pipeline bubble (waiting for the previous stage
or for the next batch), for TP rows the core's time between steps.

    .venv/bin/python benchmarks/parallel.py                    # the full run (~5 minutes on 2 cores)
    .venv/bin/python benchmarks/parallel.py --requests 8 --output-tokens 32 --rounds 2   # quicker
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["LBD_PROFILE_COLLECTIVES"] = "1"  # time collectives on CUDA too (synchronizes around each)

from lbd.engine.config.args import EngineArgs  # noqa: E402
from lbd.engine.core.engine_core import EngineCore  # noqa: E402
from lbd.engine.rank_core import build_core  # noqa: E402
from lbd.wire.core_messages import EngineCoreRequest, SamplingParams  # noqa: E402


@dataclass(slots=True)
class Config:
    name: str
    model: str  # "default" or "shaped"
    tp: int = 1
    pp: int = 1
    device: str = "cpu"
    gloo_only: bool = False  # TP all-reduces through gloo instead of shared memory (for comparison)


@dataclass(slots=True)
class Result:
    tok_s: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)  # CPU time per output token
    step_ms: list[float] = field(default_factory=list)
    coll: list[float] = field(default_factory=list)
    idle: list[float] = field(default_factory=list)


CPU_CONFIGS = [
    Config("TP=1 (2 threads)", "default"), Config("PP=2", "default", pp=2), Config("TP=3", "default", tp=3),
    Config("TP=1 (2 threads)", "shaped"), Config("TP=2", "shaped", tp=2),
    Config("TP=2, gloo all-reduce", "shaped", tp=2, gloo_only=True),
    Config("TP=2 x PP=2", "shaped", tp=2, pp=2),
]


def cuda_configs(gpus: int) -> list[Config]:
    out = [Config("TP=1", "default", device="cuda")]
    if gpus >= 2:
        out += [Config("TP=2", "shaped", tp=2, device="cuda"), Config("PP=2", "default", pp=2, device="cuda")]
    if gpus >= 4:
        out.append(Config("TP=2 x PP=2", "shaped", tp=2, pp=2, device="cuda"))
    return out


def shaped_model(folder: Path) -> Path:
    """SmolLM2's sizes with 12 heads of 48 and 4 KV heads, random weights (same FLOPs per token)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
                      rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def requests(n: int, prompt: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(prompt)] for _ in range(n)]


def cpu_seconds(core: EngineCore) -> float:
    """CPU time so far of this process (it is the core; idle engines beside it cost nothing) and of the
    rank's workers."""
    import psutil

    total = 0.0
    for pid in [os.getpid(), *getattr(core.runner, "worker_pids", list)()]:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def run_once(core: EngineCore, prompts: list[list[int]], new_tokens: int, tag: str) -> tuple[float, float]:
    """(output tok/s, median ms per collected batch while all requests decode)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"{tag}-{i}", p, params, None, 0.0))
    started: set[str] = set()
    gaps: list[float] = []
    tokens = 0
    t0 = last = time.perf_counter()
    while core.has_work():
        outs = core.step()
        if not outs:
            continue
        now = time.perf_counter()
        if len(started) == len(prompts):
            gaps.append(now - last)
        last = now
        for o in outs:
            started.add(o.request_id)
            tokens += len(o.new_token_ids)
    return tokens / (time.perf_counter() - t0), 1e3 * statistics.median(gaps or [0.0])


def shares(profile: dict[int, dict]) -> tuple[float, float]:
    """(TP collectives / busy time, idle / wall), averaged over the workers."""
    coll, idle = [], []
    for w in profile.values():
        busy = w["step_s"] - w["pp_recv_s"]  # waiting for the previous stage is not work
        coll.append(w["tp_s"] / busy if busy > 0 else 0.0)
        idle.append(1.0 - busy / w["wall_s"] if w["wall_s"] > 0 else 0.0)
    return statistics.mean(coll), statistics.mean(idle)


def build(cfg: Config, paths: dict[str, Path], kv_bytes: int, threads: int) -> EngineCore:
    args = EngineArgs(model=str(paths[cfg.model]), device=cfg.device, tensor_parallel_size=cfg.tp,
                      pipeline_parallel_size=cfg.pp, kv_cache_memory_bytes=kv_bytes, max_model_len=2048,
                      max_num_seqs=64)
    if cfg.tp * cfg.pp == 1 and cfg.device == "cpu":
        os.environ["OMP_NUM_THREADS"] = str(threads)  # read by the runner; workers get their own share
    if cfg.gloo_only:
        os.environ["LBD_SHM_ALLREDUCE"] = "0"  # inherited by the workers
    try:
        return build_core(args, str(paths[cfg.model]))
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)
        os.environ.pop("LBD_SHM_ALLREDUCE", None)


def measure(configs: list[Config], paths: dict[str, Path], ns: argparse.Namespace) -> dict[str, Result]:
    cores = {}
    for cfg in configs:
        t = time.perf_counter()
        cores[f"{cfg.model} {cfg.name}"] = build(cfg, paths, ns.kv_cache_bytes, ns.threads)
        print(f"  started {cfg.model} {cfg.name} ({cfg.device}) in {time.perf_counter() - t:.1f} s",
              flush=True)
    results = {key: Result() for key in cores}
    prompts = requests(ns.requests, ns.prompt_tokens, seed=1)
    try:
        for core in cores.values():  # warm-up: first-touch of KV pages, allocator, C kernels
            run_once(core, prompts[:2], 4, "warm")
        for r in range(ns.rounds):
            for key, core in cores.items():
                profile = getattr(core.runner, "profile", None)
                if profile:
                    profile(reset=True)
                cpu0 = cpu_seconds(core)
                tok_s, step_ms = run_once(core, prompts, ns.output_tokens, f"r{r}")
                res = results[key]
                res.cpu_ms.append(1e3 * (cpu_seconds(core) - cpu0) / (len(prompts) * ns.output_tokens))
                res.tok_s.append(tok_s)
                res.step_ms.append(step_ms)
                if profile:
                    coll, idle = shares(profile(reset=True))
                    res.coll.append(coll)
                    res.idle.append(idle)
                print(f"  round {r + 1} {key}: {tok_s:.1f} tok/s, {res.cpu_ms[-1]:.1f} CPU-ms/token, "
                      f"{step_ms:.1f} ms/step", flush=True)
    finally:
        for core in cores.values():
            core.close()
    return results


def table(title: str, results: dict[str, Result], base_keys: dict[str, str]) -> str:
    lines = [f"{title}", "", "| model | config | output tok/s | vs TP=1 | CPU ms/token | step (ms) | coll | "
             "idle / bubble |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for key, res in results.items():
        model, name = key.split(" ", 1)
        tok = statistics.median(res.tok_s)
        base = statistics.median(results[base_keys[model]].tok_s)
        coll = f"{100 * statistics.median(res.coll):.0f}%" if res.coll else "-"
        idle = f"{100 * statistics.median(res.idle):.0f}%" if res.idle else "-"
        cpu = statistics.median(res.cpu_ms)
        lines.append(f"| {model} | {name} | {tok:.1f} | {tok / base:.2f}x | {cpu:.1f} | "
                     f"{statistics.median(res.step_ms):.1f} | {coll} | {idle} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=16, help="concurrent requests per run")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over every configuration")
    p.add_argument("--threads", type=int, default=2, help="threads of the TP=1 engines on the CPU")
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="per rank (CPU) / per GPU (CUDA)")
    ns = p.parse_args()

    import torch

    from lbd.engine.loader import resolve_model
    from lbd.engine.procutil import keep_freed_memory

    keep_freed_memory()  # as the core process does: the in-process TP=1 engines run like a real rank's core

    with tempfile.TemporaryDirectory(prefix="lbd-parallel-bench-") as tmp:
        print("building the SmolLM2-shaped model ...", flush=True)
        paths = {"default": resolve_model(None), "shaped": shaped_model(Path(tmp) / "shaped")}
        base_keys = {"default": "default TP=1 (2 threads)", "shaped": "shaped TP=1 (2 threads)"}
        print(f"CPU: {len(os.sched_getaffinity(0))} cores; {ns.requests} requests x {ns.prompt_tokens} "
              f"prompt + {ns.output_tokens} new tokens, {ns.rounds} rounds", flush=True)
        out = [table("CPU (gloo)", measure(CPU_CONFIGS, paths, ns), base_keys)]
        if torch.cuda.is_available():
            configs = cuda_configs(torch.cuda.device_count())
            results = measure(configs, paths, ns)
            out.append(table(f"CUDA ({torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, NCCL)",
                             results, {"default": "default TP=1", "shaped": "default TP=1"}))
    print("\n\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
