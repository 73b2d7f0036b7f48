"""Our model over the paged cache vs transformers on the same weights: packed mixed batches, chunked prefill,
a shared cached prefix, decode steps, shuffled block ids; Llama (plain, tied + llama3 rope) and Qwen2 (qkv
bias). fp32, tight tolerance."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from lbd.engine.config.args import EngineArgs
from lbd.engine.core.request import Request
from lbd.engine.core.runner import ModelRunner
from lbd.engine.core.sched_output import ScheduledSeq
from lbd.wire.core_messages import SamplingParams

ATOL = 2e-4
RTOL = 1e-4


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Crisp random weights (and non-zero biases, so a dropped bias would show)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def _tiny(path: Path, kind: str) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=1e6, tie_word_embeddings=False))
    else:  # tied embeddings, MQA, llama3 rope scaling, a head_dim that is not hidden / heads
        cfg = LlamaConfig(**{**common, "num_key_value_heads": 1}, head_dim=32, tie_word_embeddings=True,
                          rope_theta=50000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = LlamaForCausalLM(cfg)
    _randomise(model, seed=1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["llama", "llama-tied-llama3", "qwen2"])
def checkpoint(request: pytest.FixtureRequest, tiny_llama: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "llama":
        return tiny_llama
    kind = "qwen2" if request.param == "qwen2" else "llama3"
    return _tiny(tmp_path_factory.mktemp(request.param), kind)


def _reference_logits(path: Path, seqs: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [hf(torch.tensor([s])).logits[0] for s in seqs]


class Driver:
    """Runs hand-made steps through the runner and returns the logits of every computed row."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def step(self, plan: list[tuple[Request, int]]) -> list[torch.Tensor]:
        seqs = [ScheduledSeq(r, n, True) for r, n in plan]
        batch = self.runner.prepare(seqs)
        with torch.inference_mode():
            hidden = self.runner.model(batch.input_ids, batch.positions, batch.meta, self.runner.kv_caches)
            logits = self.runner.model.compute_logits(hidden)
        out, start = [], 0
        for r, n in plan:
            out.append(logits[start:start + n])
            start += n
            r.num_computed_tokens += n
        return out


def test_paged_model_matches_transformers(checkpoint: Path) -> None:
    rng = random.Random(0)
    args = EngineArgs(model=str(checkpoint), kv_cache_memory_bytes=1 << 20)
    runner = ModelRunner.from_args(args, str(checkpoint))
    vocab, bs = runner.vocab_size, runner.block_size
    decode_steps = 6
    lens = [7, 23, 40, 37]
    tokens = [[rng.randrange(vocab) for _ in range(n + decode_steps)] for n in lens]
    tokens[3][:32] = tokens[2][:32]  # request 3 shares two full blocks with request 2 (a prefix-cache hit)
    free = list(range(runner.num_blocks))
    rng.shuffle(free)  # arbitrary, non-contiguous block ids
    reqs = []
    for i, toks in enumerate(tokens):
        r = Request(f"r{i}", toks[: lens[i]], SamplingParams(temperature=0.0), None, 0.0)
        r.all_token_ids = list(toks)  # the scheduler appends sampled tokens; here they are fixed in advance
        r.block_ids = [free.pop() for _ in range(-(-len(toks) // bs))]
        reqs.append(r)
    reqs[3].block_ids[:2] = reqs[2].block_ids[:2]
    ref = _reference_logits(checkpoint, tokens)
    got: list[list[torch.Tensor]] = [[] for _ in reqs]
    drv = Driver(runner)

    def record(plan: list[tuple[Request, int]]) -> None:
        for (r, _), logits in zip(plan, drv.step(plan), strict=True):
            got[reqs.index(r)].append(logits)

    # step 1: r0 whole prompt, r1 first chunk, r2 whole prompt (prefills only)
    record([(reqs[0], 7), (reqs[1], 10), (reqs[2], 40)])
    # step 2: decodes first (r0, r2), then r1's second chunk over its cached first chunk
    record([(reqs[0], 1), (reqs[2], 1), (reqs[1], 13)])
    # step 3: r3 starts after the 32 tokens it shares with r2 (computed by r2 already)
    reqs[3].num_computed_tokens = 32
    got[3].append(ref[3][:32])  # not computed here: the reference fills the rows that were cached
    record([(reqs[0], 1), (reqs[2], 1), (reqs[1], 1), (reqs[3], 5)])
    for _ in range(decode_steps - 2):
        record([(r, 1) for r in reqs])
    record([(reqs[3], 1)])
    for i, r in enumerate(reqs):
        ours = torch.cat(got[i])
        assert ours.shape[0] == r.num_computed_tokens
        torch.testing.assert_close(ours, ref[i][: ours.shape[0]], atol=ATOL, rtol=RTOL, msg=f"request {i}")


def test_runner_attributes(tiny_llama: Path) -> None:
    args = EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=1 << 20)
    runner = ModelRunner.from_args(args, str(tiny_llama))
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_llama)
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert runner.device == "cpu" and runner.dtype == "float32"
    assert runner.max_model_len == cfg.max_position_embeddings
    assert runner.vocab_size == cfg.vocab_size
    assert runner.eos_token_id == tok.eos_token_id
    per_block = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * (cfg.hidden_size // 4) * 4
    assert runner.num_blocks == (1 << 20) // per_block
    with pytest.raises(ValueError, match="--max-model-len"):
        ModelRunner.from_args(EngineArgs(model=str(tiny_llama), max_model_len=10**6), str(tiny_llama))
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes"):
        ModelRunner.from_args(EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=100), str(tiny_llama))



def _prefill_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    req = Request("x", ids, SamplingParams(), None, 0.0)
    req.block_ids = list(range(-(-len(ids) // runner.block_size)))
    return Driver(runner).step([(req, len(ids))])[0].float()


def test_bfloat16_runner_stays_close_to_float32(tiny_llama: Path) -> None:
    args = dict(model=str(tiny_llama), kv_cache_memory_bytes=1 << 20)
    fp32 = ModelRunner.from_args(EngineArgs(**args), str(tiny_llama))
    bf16 = ModelRunner.from_args(EngineArgs(**args, dtype="bfloat16"), str(tiny_llama))
    assert bf16.dtype == "bfloat16" and bf16.kv_caches[0][0].dtype == torch.bfloat16
    ids = list(range(3, 80))
    a, b = _prefill_logits(fp32, ids), _prefill_logits(bf16, ids)
    assert (a - b).abs().max() < 0.1 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


def test_config_json_reading_matches_transformers(checkpoint: Path, tmp_path: Path) -> None:
    """Our light config.json reader agrees with AutoConfig, for 5.x files and a 4.x-style rope layout."""
    import json
    import shutil

    from transformers import AutoConfig

    from lbd.engine.models.config import arch_config, load_hf_config

    assert arch_config(load_hf_config(checkpoint)) == arch_config(AutoConfig.from_pretrained(checkpoint))
    raw = json.loads((checkpoint / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        raw["rope_scaling"] = rope
    for key in ("tie_word_embeddings", "rms_norm_eps", "attention_bias"):  # omitted keys take class defaults
        raw.pop(key, None)
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text(json.dumps(raw))
    shutil.copy(checkpoint / "model.safetensors", old / "model.safetensors")
    assert arch_config(load_hf_config(old)) == arch_config(AutoConfig.from_pretrained(old))
