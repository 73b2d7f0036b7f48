"""The CUDA mode of benchmarks/engine_vs_vllm.py (``--device cuda``): lbd on one GPU with a random-weight
Llama-3-8B-shaped checkpoint that this script writes itself (bf16, ~16 GB, cached under --work-dir).

Reports, with CUDA graphs (the default) and without (--enforce-eager): output tok/s and TTFT/ITL at
concurrency 1, 32 and 128 (~125-token prompts, 128 output tokens, ignore_eos, greedy). Then an eager server
with --profile-steps gives the decode step's attention and linear times, turned into decode attention's share
of the HBM bandwidth (K/V bytes read per step over the time, against a measured device copy) and the linear
layers' share of peak FLOP/s (projection + lm_head FLOPs over their time, against a measured bf16 8192^3
matmul). When --vllm-python points at a CUDA build of vLLM, it runs on the same checkpoint and prompts.

Unverified: no GPU was lent while this was written; it is correct by construction and its pipeline is
exercised on the CPU with a tiny shape (``--cuda-shape tiny --cuda-on-cpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks.engine_specs import EngineSpec, RunningEngine

from lbd.bench.stats import percentile

SHAPES = {
    # Llama-3-8B: 32 layers, 4096 wide, GQA 32/8, 14336 MLP, 128256 vocab, rope 500000
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                      max_position_embeddings=8192),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=4096, rope_theta=10000.0, max_position_embeddings=2048),
}


def build_checkpoint(folder: Path, shape: str, device: str) -> Path:
    """config.json, random bf16 safetensors shards (std 0.02, norms 1) and a word-level tokenizer whose vocab
    covers every id (so any sampled id detokenizes); written once, reused while the folder is complete."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    folder = folder / f"random-{shape}"
    done = folder / ".complete"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(**SHAPES[shape], tie_word_embeddings=False, dtype="bfloat16", bos_token_id=1,
                      eos_token_id=2, architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w1", eos_token="w2", unk_token="w0")
    fast.save_pretrained(folder)
    gen = torch.Generator(device=device).manual_seed(0)
    d, inter = cfg.hidden_size, cfg.intermediate_size
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = d // heads

    def rand(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * 0.02
        return x.bfloat16().cpu()

    index: dict[str, str] = {}

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))

    shard("embed.safetensors", {"model.embed_tokens.weight": rand(cfg.vocab_size, d),
                                "lm_head.weight": rand(cfg.vocab_size, d),
                                "model.norm.weight": torch.ones(d, dtype=torch.bfloat16)})
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shard(f"layer-{i:03d}.safetensors", {
            p + "self_attn.q_proj.weight": rand(heads * hd, d),
            p + "self_attn.k_proj.weight": rand(kv * hd, d),
            p + "self_attn.v_proj.weight": rand(kv * hd, d),
            p + "self_attn.o_proj.weight": rand(d, heads * hd),
            p + "mlp.gate_proj.weight": rand(inter, d), p + "mlp.up_proj.weight": rand(inter, d),
            p + "mlp.down_proj.weight": rand(d, inter),
            p + "input_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(d, dtype=torch.bfloat16)})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    done.touch()
    return folder


def device_limits() -> tuple[float, float]:
    """(copy bandwidth in bytes/s, read + write of a 1 GiB buffer; bf16 matmul FLOP/s at 8192^3)."""
    import torch

    def timed(fn, reps: int = 20) -> float:
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / timed(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    flops = 2 * 8192**3 / timed(lambda: a @ b, 10)
    return bw, flops


def decode_shares(cfg: dict, row: dict[str, float], context: float, bw: float,
                  flops: float) -> tuple[float, float]:
    """(attention's share of HBM bandwidth, linear layers' share of peak FLOP/s) for one decode step's
    profile ``row`` (ms per step, ``seqs`` sequences) at a mean ``context`` length."""
    d, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, inter, vocab = d // heads, cfg["intermediate_size"], cfg["vocab_size"]
    seqs = row["seqs"]
    kv_bytes = seqs * context * layers * 2 * kv * hd * 2  # K and V, bf16
    attn_s = row["forward_attention"] / 1e3
    params = layers * (d * (heads + 2 * kv) * hd + heads * hd * d + 3 * d * inter) + d * vocab
    linear_s = (row["forward_linear"] + row["lm_head"]) / 1e3
    return (kv_bytes / attn_s / bw if attn_s else float("nan"),
            2 * seqs * params / linear_s / flops if linear_s else float("nan"))


def main(args: argparse.Namespace) -> int:
    from benchmarks.engine_specs import vllm_available
    from benchmarks.engine_vs_vllm import Workload, average_rows, measure, profile_level

    work = Path(args.work_dir or os.environ.get("LBD_CACHE_DIR", Path.home() / ".cache" / "lbd")) / "bench"
    on_cpu = args.cuda_on_cpu
    model = build_checkpoint(work, args.cuda_shape, "cpu" if on_cpu else "cuda")
    cfg = json.loads((model / "config.json").read_text())
    spec = args.concurrency if args.concurrency != "1,8,32,64" else "1,32,128"  # the CPU default -> CUDA's
    levels = [int(c) for c in spec.split(",")]
    workload = Workload(args.input_len, args.output_len, cfg["vocab_size"])
    device = "cpu" if on_cpu else "cuda"
    dev_args, dtype = ["--device", device], "float32" if on_cpu else "bfloat16"
    variants = {"lbd (CUDA graphs)": EngineSpec("lbd-graphs", "lbd", dtype, dev_args),
                "lbd (eager)": EngineSpec("lbd-eager", "lbd", dtype, [*dev_args, "--enforce-eager"])}
    if vllm_available(args.vllm_python) is None and not on_cpu:  # a CUDA build of vLLM given
        variants["vLLM"] = EngineSpec("vllm", "vllm", dtype)
    logdir = work / f"logs-{time.strftime('%Y%m%d-%H%M%S')}"
    logdir.mkdir(parents=True)
    # KV cache: lbd and vLLM size it from --gpu-memory-utilization (0.9) on CUDA; the CPU smoke run gets 1 GiB
    common = dict(model=model, cpus="", threads=os.cpu_count() or 1, kv_gib=1.0 if on_cpu else 0.0,
                  max_model_len=args.max_model_len, device=device, python=args.vllm_python,
                  ready_timeout=args.ready_timeout)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}  {model}  levels {levels}  device {device}", flush=True)
    rows = ["| engine | conc | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |",
            "|---|---:|---:|---:|---:|"]
    for label, spec in variants.items():
        eng = RunningEngine(spec, log=logdir / f"{spec.name}.log", **common)
        try:
            print(f"started {label} in {eng.startup_s:.1f} s", flush=True)
            measure(eng, workload.prompts(8, 99, 8), 16, 8, -1)
            for c in levels:
                n = args.requests or max(4, 2 * c)
                r = measure(eng, workload.prompts(n, 0, c), args.output_len, c, 0)
                rows.append(f"| {label} | {c} | {r.tok_s:.1f} | {percentile(r.ttft, 50) * 1e3:.0f} / "
                            f"{percentile(r.ttft, 99) * 1e3:.0f} | {percentile(r.itl, 50) * 1e3:.1f} / "
                            f"{percentile(r.itl, 99) * 1e3:.1f} |")
                print(rows[-1], flush=True)
        finally:
            eng.close()
    print("\n" + "\n".join(rows))
    bw, flops = (float("nan"), float("nan")) if on_cpu else device_limits()  # the smoke run: no shares
    print(f"\ndevice: copy {bw / 1e9:.0f} GB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    prof = EngineSpec("lbd-profile", "lbd", dtype, [*dev_args, "--enforce-eager", "--profile-steps", "16"])
    eng = RunningEngine(prof, log=logdir / "profile.log", **common)
    context = args.input_len + args.output_len / 2  # mean context of a decode step over a request's life
    try:
        print("\n| conc | decode step ms | attention ms | linear + lm_head ms | attention % of HBM | "
              "linear % of peak FLOP/s |\n|---:|---:|---:|---:|---:|---:|")
        for c in levels:
            core, _ = profile_level(eng, workload, c, args.requests or max(4, 2 * c))
            decode = average_rows([r for r in core if r.get("kind") == "decode"])
            if decode is None:
                continue
            hbm, peak = decode_shares(cfg, decode, context, bw, flops)
            print(f"| {c} | {decode['step_ms']:.2f} | {decode['forward_attention']:.2f} | "
                  f"{decode['forward_linear'] + decode['lm_head']:.2f} | {100 * hbm:.0f}% | "
                  f"{100 * peak:.0f}% |")
    finally:
        eng.close()
    return 0
