"""The simulated accelerator: a model runner whose forward pass is a sleep of the profiled step time.

Everything around it is real (front end, scheduler, KV-cache manager, prefix cache, metrics, ZMQ): only
``execute`` differs. It sleeps (no busy wait, so 16 simulated ranks fit two cores) for
``SimProfile.step_time`` of what the step computes, and answers deterministic tokens: a hash of (seed, prompt
tokens, output position) picks one of the tokenizer's ordinary word tokens, so the same prompt gets the same
text on every rank and every run, and text never ends early (no eos: requests end at max_tokens or a stop).

No torch here: config.json, generation_config.json and tokenizer.json are read with json.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

from lbd.engine.config.args import EngineArgs
from lbd.engine.config.lora import LoraFlags
from lbd.engine.config.slices import CacheConfig, ModelConfig, engine_config
from lbd.engine.core.request import Request
from lbd.engine.core.sched_output import SampledToken, SchedulerOutput
from lbd.engine.core.sim_lora import SimLoras
from lbd.engine.sim_profiles import SimProfile, StepShape, get_profile
from lbd.wire.core_messages import TokenLogprobs

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_WORD = re.compile(r"^[\u0120\u2581][a-z]{2,12}$")  # byte-level BPE (Ġ) or sentencepiece (▁) + a word
_LOOSE_WORD = re.compile(r"^[\u0120\u2581 ]?[A-Za-z]+$")
_MIN_WORDS = 16


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread integer hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(slots=True)
class ModelFacts:
    vocab_size: int
    eos_token_id: int | None
    word_ids: list[int]


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _first(value: object) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return int(value) if isinstance(value, int) else None


def _vocab_entries(tokenizer: dict) -> list[tuple[str, int]]:
    vocab = tokenizer.get("model", {}).get("vocab", {})
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel
        return [(tok, int(i)) for tok, i in vocab.items()]
    return [(entry[0], i) for i, entry in enumerate(vocab)]  # Unigram: [token, score] by id


def read_model_facts(model_path: Path) -> ModelFacts:
    """Vocabulary size, eos and the ordinary word tokens of the model in ``model_path``."""
    config = _read_json(model_path / "config.json")
    gen = _read_json(model_path / "generation_config.json")
    tokenizer = _read_json(model_path / "tokenizer.json")
    entries = _vocab_entries(tokenizer)
    specials = {int(t["id"]) for t in tokenizer.get("added_tokens", [])}
    vocab_size = int(config.get("vocab_size") or (max((i for _, i in entries), default=-1) + 1))
    eos = _first(gen.get("eos_token_id", config.get("eos_token_id")))
    usable = [(tok, i) for tok, i in entries if i < vocab_size and i not in specials and i != eos]
    words = sorted(i for tok, i in usable if _WORD.match(tok))
    if len(words) < _MIN_WORDS:
        words = sorted(i for tok, i in usable if _LOOSE_WORD.match(tok))
    if len(words) < 2:
        words = sorted(i for _, i in usable) or [
            i for i in range(vocab_size) if i != eos and i not in specials
        ]
    if not words:
        raise ValueError(f"{model_path}: no usable output tokens for the simulated device")
    return ModelFacts(vocab_size=vocab_size, eos_token_id=eos, word_ids=words)


def step_shape(out: SchedulerOutput) -> StepShape:
    """Prefill tokens, decodes, KV tokens read and attention pairs of one scheduled step."""
    prefill_tokens = prefill_seqs = decode_seqs = kv_read = pairs = 0
    for seq in out.seqs:
        request, n = seq.request, seq.num_new_tokens
        start = request.num_computed_tokens
        if n == 1 and start == request.num_tokens - 1 and request.output_token_ids:
            decode_seqs += 1
        else:
            prefill_tokens += n
            prefill_seqs += 1
        kv_read += start + n
        pairs += n * start + n * (n + 1) // 2
    return StepShape(
        prefill_tokens=prefill_tokens,
        prefill_seqs=prefill_seqs,
        decode_seqs=decode_seqs,
        kv_tokens_read=kv_read,
        attn_pairs=pairs,
    )


class SimRunner:
    """Drop-in for ``ModelRunner`` with ``--device sim``: same attributes, same ``execute``."""

    device = "sim"
    dtype = "bfloat16"

    def __init__(self, model_path: Path | str, model: ModelConfig, cache: CacheConfig) -> None:
        self.profile: SimProfile = get_profile(model.sim_profile)
        facts = read_model_facts(Path(model_path))
        self.vocab_size = facts.vocab_size
        self.eos_token_id = facts.eos_token_id
        self._words = facts.word_ids
        self.block_size = cache.block_size
        self.max_model_len = model.max_model_len or self.profile.max_model_len
        self.num_blocks = self.profile.num_blocks(
            cache.block_size, cache.gpu_memory_utilization, cache.kv_cache_memory_bytes
        )
        self._seed = _mix64(model.seed)
        self._keys: dict[str, int] = {}  # request id -> hash of (seed, prompt)
        self.steps = 0
        self.last_shape = StepShape()
        self.last_step_s = 0.0  # modelled time of the last step
        self.loras: SimLoras | None = None  # --enable-lora
        logger.info(
            "sim device: profile %s (%s), %d KV blocks of %d, time scale %g",
            self.profile.name,
            self.profile.description,
            self.num_blocks,
            self.block_size,
            self.profile.time_scale,
        )

    @classmethod
    def from_args(cls, args: EngineArgs, model_path: Path | str) -> SimRunner:
        """From the command line (its model and cache slices)."""
        cfg = engine_config(args, "sim")
        return cls(model_path, cfg.model, cfg.cache)

    def enable_lora(self, flags: LoraFlags) -> SimLoras:
        """Model ``flags.max_loras`` adapter slots and their load time (``lbd.engine.core.sim_lora``)."""
        p = self.profile
        self.loras = SimLoras(flags, p.time_scale * p.lora_load_s, p.time_scale * p.lora_copy_s)
        return self.loras

    def execute(self, out: SchedulerOutput) -> list[SampledToken]:
        start = time.perf_counter()
        for request_id in out.finished_ids:
            self._keys.pop(request_id, None)
        shape = step_shape(out)
        sampled = [self._sample(seq.request) for seq in out.seqs if seq.sample]
        self.last_shape, self.last_step_s = shape, self.profile.step_time(shape)
        if self.loras is not None:  # adapters this step's admissions put into slots
            self.last_step_s += self.loras.take_owed()
        self.steps += 1
        remaining = start + self.last_step_s - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return sampled

    def _key(self, request: Request) -> int:
        key = self._keys.get(request.request_id)
        if key is None:
            digest = hashlib.blake2b(array("q", request.prompt_token_ids).tobytes(), digest_size=8).digest()
            key = _mix64(self._seed ^ int.from_bytes(digest, "little"))
            self._keys[request.request_id] = key
        return key

    def token_at(self, key: int, position: int) -> int:
        return self._words[_mix64((key + position * 0x9E3779B97F4A7C15) & _MASK64) % len(self._words)]

    def _sample(self, request: Request) -> SampledToken:
        key, position = self._key(request), len(request.output_token_ids)
        token = self.token_at(key, position)
        k = request.sampling.logprobs
        if k is None:
            return SampledToken(request.request_id, token)
        return SampledToken(request.request_id, token, self._logprobs(key, position, token, k))

    def _logprobs(self, key: int, position: int, token: int, k: int) -> TokenLogprobs:
        """The simulated distribution: the chosen token holds half the mass, the next words share the rest."""
        top_ids, salt = [token], 1
        while len(top_ids) < k and salt < 4 * k + 4:
            candidate = self.token_at(key ^ salt, position)
            if candidate not in top_ids:
                top_ids.append(candidate)
            salt += 1
        top_ids = top_ids[:k]
        top_logprobs = [math.log(0.5 / 2**i) for i in range(len(top_ids))]
        return TokenLogprobs(token_logprob=math.log(0.5), top_ids=top_ids, top_logprobs=top_logprobs)
