"""The architectures the engine serves and what each supports, by name: no torch, so the launcher and the
supervisor refuse a flag before anything heavy starts. ``lbd.engine.models`` builds the classes named here.
"""

from __future__ import annotations

from typing import Any

# architecture name -> (module path, class name, qkv bias override or None = from config.attention_bias)
ARCHITECTURES: dict[str, tuple[str, str, bool | None]] = {
    "LlamaForCausalLM": ("lbd.engine.models.llama", "LlamaForCausalLM", None),
    "MistralForCausalLM": ("lbd.engine.models.llama", "LlamaForCausalLM", None),
    "Qwen2ForCausalLM": ("lbd.engine.models.llama", "LlamaForCausalLM", True),
    # these read their own extra config (qk norms, experts, MLA) in ``from_hf_config``
    "Qwen3ForCausalLM": ("lbd.engine.models.qwen3", "Qwen3ForCausalLM", None),
    "Qwen3MoeForCausalLM": ("lbd.engine.models.qwen3", "Qwen3MoeForCausalLM", None),
    "MixtralForCausalLM": ("lbd.engine.models.mixtral", "MixtralForCausalLM", None),
    "DeepseekV2ForCausalLM": ("lbd.engine.models.deepseek_v2", "DeepseekV2ForCausalLM", None),
}
# What the classes declare, by name, so the launcher can refuse flags without importing torch (a test keeps
# these in agreement with the classes): ``supports_parallel = True`` (TP/PP) ...
PARALLEL_ARCHITECTURES: frozenset[str] = frozenset({"LlamaForCausalLM", "MistralForCausalLM",
                                                    "Qwen2ForCausalLM"})
# ... MoE models (subclasses of moe.MoECausalLM: their DP ranks form a group, lbd.engine.dp) ...
MOE_ARCHITECTURES: frozenset[str] = frozenset({"MixtralForCausalLM", "Qwen3MoeForCausalLM",
                                               "DeepseekV2ForCausalLM"})
# ... and ``supports_fp8_kv_cache = False`` (an MLA latent cache)
NO_FP8_KV_CACHE: frozenset[str] = frozenset({"DeepseekV2ForCausalLM"})


def is_moe(architectures: Any) -> bool:
    """Whether a model of these architectures is MoE (its DP ranks form one group)."""
    return any(a in MOE_ARCHITECTURES for a in architectures or ())


def unsupported_flags(hf_config: Any, tensor_parallel: int, pipeline_parallel: int,
                      kv_cache_dtype: str) -> str | None:
    """Why these engine flags cannot serve this model (None = they can), from names alone: the launcher,
    which hosts front end 0, and the supervisor never import torch."""
    arch = next((a for a in getattr(hf_config, "architectures", None) or [] if a in ARCHITECTURES), None)
    if arch is None:
        return None  # the core names the supported architectures
    if tensor_parallel * pipeline_parallel > 1 and arch not in PARALLEL_ARCHITECTURES:
        return (f"--tensor-parallel-size {tensor_parallel} / --pipeline-parallel-size {pipeline_parallel}: "
                f"{arch} does not support tensor or pipeline parallelism yet (supported: "
                f"{', '.join(sorted(PARALLEL_ARCHITECTURES))}): pass 1 for both")
    if kv_cache_dtype != "auto" and arch in NO_FP8_KV_CACHE:
        return (f"--kv-cache-dtype {kv_cache_dtype}: {arch} keeps an MLA latent cache, which has no fp8 form "
                "yet; pass --kv-cache-dtype auto")
    return None
