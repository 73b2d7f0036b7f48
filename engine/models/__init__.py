"""Model implementations over paged attention, chosen by ``config.architectures``.

Tensor/pipeline parallelism: a model class that handles it declares ``supports_parallel = True`` and takes a
``parallel`` keyword (an ``engine.distributed.context.ParallelContext``: its TP slice and pipeline stage);
every other class is refused with TP or PP > 1, by ``unsupported_flags``, the one place that decides it (the
launcher and the supervisor call it through ``engine.distributed.check`` before anything starts, from names
alone). ``PARALLEL_ARCHITECTURES`` / ``NO_FP8_KV_CACHE`` say by name what the classes declare;
tests/engine/test_moe_loading.py keeps them in agreement.
"""

from __future__ import annotations

from typing import Any

# architecture name -> (module path, class name, qkv bias override or None = from config.attention_bias)
ARCHITECTURES: dict[str, tuple[str, str, bool | None]] = {
    "LlamaForCausalLM": ("engine.models.llama", "LlamaForCausalLM", None),
    "MistralForCausalLM": ("engine.models.llama", "LlamaForCausalLM", None),
    "Qwen2ForCausalLM": ("engine.models.llama", "LlamaForCausalLM", True),
    # these read their own extra config (qk norms, experts, MLA) in ``from_hf_config``
    "Qwen3ForCausalLM": ("engine.models.qwen3", "Qwen3ForCausalLM", None),
    "Qwen3MoeForCausalLM": ("engine.models.qwen3", "Qwen3MoeForCausalLM", None),
    "MixtralForCausalLM": ("engine.models.mixtral", "MixtralForCausalLM", None),
    "DeepseekV2ForCausalLM": ("engine.models.deepseek_v2", "DeepseekV2ForCausalLM", None),
}
# What the classes declare, by name, so the launcher can refuse flags without importing torch (a test keeps
# these in agreement with the classes): ``supports_parallel = True`` (TP/PP) ...
PARALLEL_ARCHITECTURES: frozenset[str] = frozenset({"LlamaForCausalLM", "MistralForCausalLM",
                                                    "Qwen2ForCausalLM"})
# ... MoE models (subclasses of engine.models.moe.MoECausalLM: their DP ranks form a group, engine.dp) ...
MOE_ARCHITECTURES: frozenset[str] = frozenset({"MixtralForCausalLM", "Qwen3MoeForCausalLM",
                                               "DeepseekV2ForCausalLM"})
# ... and ``supports_fp8_kv_cache = False`` (an MLA latent cache)
NO_FP8_KV_CACHE: frozenset[str] = frozenset({"DeepseekV2ForCausalLM"})


def model_class(hf_config: Any) -> type:
    """The class serving ``config.architectures`` (imports torch); ValueError naming the supported ones."""
    import importlib

    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in ARCHITECTURES:
            module, cls_name, _ = ARCHITECTURES[arch]
            return getattr(importlib.import_module(module), cls_name)
    raise ValueError(f"unsupported architecture {archs or '(none in config.json)'}: "
                     f"supported are {sorted(ARCHITECTURES)}")


def build_model(hf_config: Any, max_positions: int, parallel: Any = None, **options: Any):
    """Our model for a transformers config, with uninitialised weights on the current default device.

    ``parallel`` (a ParallelContext spanning more than one worker) makes it this worker's shard: its TP
    slice of every layer, and only its pipeline stage's layers. ``options`` go to classes with
    ``from_hf_config`` (e.g. ``expert_shard`` for MoE models)."""
    from engine.models.config import arch_config

    cls = model_class(hf_config)
    sharded = parallel is not None and parallel.layout.world_size > 1
    if sharded:
        problem = unsupported_flags(hf_config, parallel.tp_size, parallel.pp_size, "auto")
        if problem or not getattr(cls, "supports_parallel", False):
            raise ValueError(problem or f"{cls.__name__} does not support tensor or pipeline parallelism")
        options["parallel"] = parallel
    if hasattr(cls, "from_hf_config"):
        return cls.from_hf_config(hf_config, max_positions, **options)
    extra = set(options) - {"parallel"}
    if extra:
        raise ValueError(f"{cls.__name__} takes no model options, got {sorted(extra)}")
    qkv_bias = next(ARCHITECTURES[a][2] for a in hf_config.architectures if a in ARCHITECTURES)
    return cls(arch_config(hf_config, qkv_bias=qkv_bias), max_positions, **options)


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
