"""The architecture facts our models need, read once from config.json (transformers 4.x or 5.x layouts).

The core process reads config.json itself instead of through ``transformers.AutoConfig``: importing that adds
seconds to every start (benchmarks/RESULTS.md, "Config read"). Keys a config.json may omit fall back to the
defaults of transformers' classes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

_COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "rope_theta": 10000.0, "rope_scaling": None, "rope_parameters": None, "head_dim": None,
    "num_key_value_heads": None, "partial_rotary_factor": 1.0, "sliding_window": None, "layer_types": None,
    "eos_token_id": None,
}
# transformers' per-class defaults where they differ (e.g. MistralConfig enables a 4096-token window)
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048},
    "MistralForCausalLM": {"max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "use_sliding_window": False,
                         "sliding_window": 4096},
    "MixtralForCausalLM": {"max_position_embeddings": 4096 * 32, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
                           "num_local_experts": 8, "num_experts_per_tok": 2},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "head_dim": 128, "use_sliding_window": False,
                         "sliding_window": 4096},
    "Qwen3MoeForCausalLM": {"max_position_embeddings": 32768, "use_sliding_window": False,
                            "sliding_window": 4096, "decoder_sparse_step": 1, "moe_intermediate_size": 768,
                            "num_experts_per_tok": 8, "num_local_experts": 128, "norm_topk_prob": False,
                            "mlp_only_layers": []},
    "DeepseekV2ForCausalLM": {"max_position_embeddings": 2048, "first_k_dense_replace": 0,
                              "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": 1536, "n_group": None,
                              "topk_group": None, "n_routed_experts": 64, "n_shared_experts": 2,
                              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                              "routed_scaling_factor": 1.0, "topk_method": "greedy", "norm_topk_prob": False,
                              "num_experts_per_tok": None, "moe_intermediate_size": 1407},
}
# transformers' attribute_map: other names config.json may use for the same key (ours: the value)
_ALIASES: dict[str, dict[str, str]] = {
    "MixtralForCausalLM": {"num_experts": "num_local_experts"},
    "Qwen3MoeForCausalLM": {"num_experts": "num_local_experts"},
    "DeepseekV2ForCausalLM": {"num_experts": "n_routed_experts"},
}


def load_hf_config(folder: Path | str) -> SimpleNamespace:
    """config.json as attributes, with transformers' defaults for keys it omits."""
    raw = json.loads((Path(folder) / "config.json").read_text())
    arch = (raw.get("architectures") or [""])[0]
    for alias, key in _ALIASES.get(arch, {}).items():
        if alias in raw and key not in raw:
            raw[key] = raw.pop(alias)
    return SimpleNamespace(**{**_COMMON_DEFAULTS, **_ARCH_DEFAULTS.get(arch, {}), **raw})


@dataclass(slots=True)
class ArchConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None = plain RoPE; else the HF scaling dict (rope_type, factor, ...)
    rotary_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None  # only set when the model really uses one
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before rotary


def _rope(config: Any) -> tuple[float, dict | None]:
    """(theta, scaling dict or None): 5.x keeps both in ``rope_parameters``, 4.x in two attributes."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(getattr(config, "rope_theta", None) or 10000.0)
        scaling = dict(getattr(config, "rope_scaling", None) or {})
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return theta, None
    scaling.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return theta, scaling


def _sliding_window(config: Any) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types and all(t == "full_attention" for t in layer_types):
        return None
    return int(window)


def arch_config(config: Any, qkv_bias: bool | None = None) -> ArchConfig:
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r}: only SiLU-gated MLPs are supported")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    theta, scaling = _rope(config)
    attention_bias = bool(getattr(config, "attention_bias", False))
    return ArchConfig(
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        rms_norm_eps=float(config.rms_norm_eps),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=int(head_dim * float(getattr(config, "partial_rotary_factor", 1.0) or 1.0)),
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
        o_bias=attention_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        sliding_window=_sliding_window(config),
    )
