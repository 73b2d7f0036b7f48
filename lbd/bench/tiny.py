"""Tiny random-weight checkpoints (Llama with a small byte-level BPE tokenizer and ChatML), for tests and
benchmarks. torch, tokenizers and transformers are imported inside the functions: importing this module costs
nothing, so the router and the supervisor never pay for it."""

from __future__ import annotations

from pathlib import Path

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CORPUS = [
    "The capital of France is Paris. The capital of Germany is Berlin. Hello world, how are you today?",
    "Once upon a time there was a tiny model that learned to count: one two three four five six seven.",
    "def add(a, b):\n    return a + b\n# numbers 0123456789 and symbols !?.,;:-_()[]{}<>",
]


def make_tokenizer(path: Path, vocab_size: int = 384):
    """A small byte-level BPE tokenizer (any text encodes) with ChatML specials, saved to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    return fast


def make_tiny_llama(path: Path, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                    intermediate: int = 128, max_pos: int = 512, seed: int = 0, tie: bool = False,
                    dtype: str = "float32") -> Path:
    """A random-weight Llama checkpoint (config.json + model.safetensors + tokenizer) in ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(path)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_pos, rope_theta=10000.0, tie_word_embeddings=tie,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    # Random init gives near-uniform logits (many near-ties); a larger scale makes greedy choices crisp.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return path
