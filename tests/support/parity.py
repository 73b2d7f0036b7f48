"""Engine-vs-transformers parity helpers: run prompts through an EngineCore and through transformers'
own generate, and compare greedy tokens and top logprobs with a near-tie allowance."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lbd.engine.config.args import EngineArgs
from lbd.engine.core.engine_core import EngineCore
from lbd.engine.rank_core import build_core
from lbd.wire.core_messages import EngineCoreRequest, SamplingParams

TOP = 5
NEAR_TIE = 1e-3


@dataclass(slots=True)
class Run:
    """One request's generated tokens and, per position, the top-5 logprobs {token: logprob}."""

    tokens: list[int] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    chosen: list[float] = field(default_factory=list)  # logprob of the generated token


def assert_greedy_close(ours: Run, ref: Run, name: str = "", near_tie: float = NEAR_TIE,
                        logprob_tol: float = 1e-2) -> int:
    """Token-for-token equality up to a near-tie; returns how many positions were compared."""
    for pos, (a, b) in enumerate(zip(ours.tokens, ref.tokens, strict=False)):
        if a == b:
            assert abs(ours.chosen[pos] - ref.chosen[pos]) < logprob_tol, (name, pos, ours.chosen, ref.chosen)
            continue
        mo, mr = ours.top[pos], ref.top[pos]
        tie = (a in mr and b in mo and abs(mo[a] - mo[b]) < near_tie and abs(mr[a] - mr[b]) < near_tie)
        assert tie, (f"{name}: token {pos} differs: ours {a} (top {mo}) vs transformers {b} (top {mr}); "
                     f"ours so far {ours.tokens[:pos + 1]}")
        return pos
    assert len(ours.tokens) == len(ref.tokens), (name, ours.tokens, ref.tokens)
    return len(ours.tokens)


def assert_all_close(ours: list[Run], refs: list[Run], near_tie: float = NEAR_TIE, logprob_tol: float = 1e-2,
                     min_compared: float = 0.8) -> None:
    pairs = enumerate(zip(ours, refs, strict=True))
    compared = sum(assert_greedy_close(o, r, f"request {i}", near_tie, logprob_tol) for i, (o, r) in pairs)
    total = sum(len(r.tokens) for r in refs)
    assert compared >= min_compared * total, f"only {compared} of {total} tokens compared: too many near-ties"


# ------------------------------------------------------------------------------------------- both sides


def hf_greedy(path: Path | str, prompts: list[list[int]], max_tokens: list[int],
              dtype: torch.dtype = torch.float32) -> list[Run]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # our requests ignore eos; so must the reference
    runs = []
    for prompt, n in zip(prompts, max_tokens, strict=True):
        gc = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), generation_config=gc)
        run = Run(out.sequences[0, len(prompt):].tolist())
        for tok, logits in zip(run.tokens, out.logits, strict=True):
            lp = torch.log_softmax(logits[0].float(), -1)
            vals, ids = lp.topk(TOP)
            run.top.append(dict(zip(ids.tolist(), vals.tolist(), strict=True)))
            run.chosen.append(lp[tok].item())
        runs.append(run)
    return runs


def engine_args(path: Path | str, **kw: object) -> EngineArgs:
    kw.setdefault("kv_cache_memory_bytes", 64 << 20)
    return EngineArgs(model=str(path), **kw)


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=TOP, **kw)


def run_engine(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams],
               prefix: str = "r") -> list[Run]:
    """Submit all at once and step until every request finishes."""
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        core.add_request(EngineCoreRequest(rid, prompt, p, None, 0.0))
    runs = {rid: Run() for rid in ids}
    finished: set[str] = set()
    for _ in range(100_000):
        if not core.has_work():
            break
        for out in core.step():
            run = runs[out.request_id]
            run.tokens += out.new_token_ids
            for lp in out.new_logprobs or []:
                run.top.append(dict(zip(lp.top_ids, lp.top_logprobs, strict=True)))
                run.chosen.append(lp.token_logprob)
            if out.finish_reason is not None:
                finished.add(out.request_id)
    assert finished == set(ids)
    return [runs[rid] for rid in ids]


def random_prompts(n: int, lens: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lens))] for _ in range(n)]


PARALLEL_BLOCKS = 20  # the 16 requests need more: preemptions (max_model_len 256 needs 16)


def parallel_core(path: Path, tp: int = 1, pp: int = 1, partition: str | None = None,
                  **kw: object) -> EngineCore:
    """A core for the TP/PP parity scenario: a KV cache of PARALLEL_BLOCKS blocks, so it preempts."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    rank_kv_heads = max(1, cfg.num_key_value_heads // tp) * tp  # replicated heads cost their memory
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_block = 2 * cfg.num_hidden_layers * 16 * rank_kv_heads * head_dim * 4
    return build_core(engine_args(path, kv_cache_memory_bytes=PARALLEL_BLOCKS * per_block, max_model_len=256,
                                  max_num_batched_tokens=32, tensor_parallel_size=tp,
                                  pipeline_parallel_size=pp, pp_layer_partition=partition, **kw), str(path))


def parallel_scenario(core: EngineCore, vocab: int) -> list[Run]:
    """Shared prefixes, mixed lengths, seeded sampling and preemptions; asserts nothing leaked."""
    rng = random.Random(11)
    shared = [rng.randrange(3, vocab) for _ in range(48)]
    warm = run_engine(core, [shared + [5, 6]], [greedy(6)], prefix="warm")
    hits = core.scheduler.kv.prefix_hits
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))] for _ in range(6)]
    prompts += [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 150))] for _ in range(10)]
    params = [greedy(rng.randint(4, 32)) for _ in prompts]
    sampled = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=24, ignore_eos=True,
                              repetition_penalty=1.3, frequency_penalty=0.4) for s in (7, 8)]
    prompts += [[rng.randrange(3, vocab) for _ in range(30)] for _ in sampled]
    runs = run_engine(core, prompts, params + sampled, prefix="s")
    assert core.scheduler.kv.prefix_hits - hits >= 6 * 48, "the shared prefix was not served from the cache"
    assert core.scheduler.counters.num_preemptions > 0, "the scenario did not preempt"
    assert core.scheduler.kv.num_free_blocks == core.runner.num_blocks  # nothing leaked
    return warm + runs
