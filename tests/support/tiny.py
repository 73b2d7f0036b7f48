"""Tiny random-weight checkpoints (Llama, Mixtral, Qwen3, Qwen3-MoE, DeepSeek-V2; a small byte-level BPE
tokenizer with ChatML), for tests and benchmarks. torch, tokenizers and transformers are imported inside the
functions: importing this module costs nothing, so the router and the supervisor never pay for it."""

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


def _save_tiny(path: Path, make_config, model_cls_name: str, seed: int) -> Path:
    """A random-weight checkpoint + tokenizer: ``make_config(tokenizer)`` builds transformers' config."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(path)
    torch.manual_seed(seed)
    cfg = make_config(tok)
    model = getattr(transformers, model_cls_name)(cfg).float()
    # Crisp weights (clear greedy choices), routers crisper still (no near-tied expert choices), and norm
    # weights away from 1 (a norm applied to the wrong tensor shows).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif "norm" in name:
                p.uniform_(0.6, 1.4)
    model.save_pretrained(path)
    return path


def _common(tok, layers: int, hidden: int, heads: int, max_pos: int) -> dict:
    return dict(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                max_position_embeddings=max_pos, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                rms_norm_eps=1e-6, tie_word_embeddings=False)


def make_tiny_mixtral(path: Path, *, layers: int = 2, hidden: int = 64, experts: int = 4, seed: int = 0,
                      max_pos: int = 512) -> Path:
    """Mixtral: 4 heads (2 KV), top-2 of ``experts`` experts of 96 in every layer."""
    from transformers import MixtralConfig

    return _save_tiny(path, lambda tok: MixtralConfig(
        **_common(tok, layers, hidden, 4, max_pos), num_key_value_heads=2, intermediate_size=96,
        num_local_experts=experts, num_experts_per_tok=2, rope_theta=10000.0), "MixtralForCausalLM", seed)


def make_tiny_qwen3(path: Path, *, layers: int = 2, seed: int = 0, max_pos: int = 512) -> Path:
    """Dense Qwen3: hidden 64, 4 heads (2 KV) of head_dim 32 (not hidden / heads), q/k norms."""
    from transformers import Qwen3Config

    return _save_tiny(path, lambda tok: Qwen3Config(
        **_common(tok, layers, 64, 4, max_pos), num_key_value_heads=2, head_dim=32, intermediate_size=128),
        "Qwen3ForCausalLM", seed)


def make_tiny_qwen3_moe(path: Path, *, layers: int = 2, experts: int = 8, seed: int = 0, max_pos: int = 512,
                        norm_topk_prob: bool = True, mlp_only_layers: tuple[int, ...] = (0,)) -> Path:
    """Qwen3-MoE: q/k norms, top-2 of ``experts`` experts of 32; ``mlp_only_layers`` dense (96)."""
    from transformers import Qwen3MoeConfig

    return _save_tiny(path, lambda tok: Qwen3MoeConfig(
        **_common(tok, layers, 64, 4, max_pos), num_key_value_heads=2, head_dim=16, intermediate_size=96,
        moe_intermediate_size=32, num_experts=experts, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
        mlp_only_layers=list(mlp_only_layers)), "Qwen3MoeForCausalLM", seed)


def make_tiny_deepseek_v2(path: Path, *, layers: int = 2, experts: int = 8, seed: int = 0, max_pos: int = 512,
                          q_lora_rank: int | None = None, topk_method: str = "greedy",
                          yarn: bool = False) -> Path:
    """DeepSeek-V2 with MLA (kv_lora_rank 32, nope 16 + rope 8, v 16; ``q_lora_rank`` None as in V2-Lite),
    layer 0 dense, then top-2 of ``experts`` routed experts + 1 shared (routed_scaling_factor 1.5).
    ``topk_method="group_limited_greedy"``: 4 groups, the best 2 compete. ``yarn``: yarn rope (factor 4
    over 128 original positions) with mscale 0.9 / mscale_all_dim 0.7, which also scales the softmax."""
    from transformers import DeepseekV2Config

    rope: dict = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.9,
                "mscale_all_dim": 0.7}
    groups = dict(n_group=4, topk_group=2) if topk_method == "group_limited_greedy" else {}
    return _save_tiny(path, lambda tok: DeepseekV2Config(
        **_common(tok, layers, 64, 4, max_pos), intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=experts, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        kv_lora_rank=32, q_lora_rank=q_lora_rank, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        routed_scaling_factor=1.5, topk_method=topk_method, rope_parameters=rope, **groups),
        "DeepseekV2ForCausalLM", seed)
