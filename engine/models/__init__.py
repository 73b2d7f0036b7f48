"""Model implementations over paged attention, chosen by ``config.architectures``.

Tensor/pipeline parallelism: a model class that handles it declares ``supports_parallel = True`` and takes a
``parallel`` keyword (an ``engine.distributed.context.ParallelContext``); every other class is built with
``cls(arch_config, max_positions)`` and refused with TP or PP > 1. ``PARALLEL_ARCHITECTURES`` names the
architectures whose class declares it, so the start-up checks (``engine.distributed.check``) can refuse a
combination without importing torch; tests/engine/test_parallel_layers.py keeps the two in agreement.
"""

from __future__ import annotations

from typing import Any

# architecture name -> (module path, class name, qkv bias override or None = from config.attention_bias)
ARCHITECTURES: dict[str, tuple[str, str, bool | None]] = {
    "LlamaForCausalLM": ("engine.models.llama", "LlamaForCausalLM", None),
    "MistralForCausalLM": ("engine.models.llama", "LlamaForCausalLM", None),
    "Qwen2ForCausalLM": ("engine.models.llama", "LlamaForCausalLM", True),
}

PARALLEL_ARCHITECTURES: frozenset[str] = frozenset({"LlamaForCausalLM", "MistralForCausalLM",
                                                    "Qwen2ForCausalLM"})


def build_model(hf_config: Any, max_positions: int, parallel: Any = None):
    """Our model for a transformers config, with uninitialised weights on the current default device.

    ``parallel`` (a ParallelContext) makes it this worker's shard: its TP slice of every layer, and only its
    pipeline stage's layers."""
    import importlib

    from engine.models.config import arch_config

    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in ARCHITECTURES:
            module, cls_name, qkv_bias = ARCHITECTURES[arch]
            cls = getattr(importlib.import_module(module), cls_name)
            cfg = arch_config(hf_config, qkv_bias=qkv_bias)
            if parallel is None or parallel.layout.world_size == 1:
                return cls(cfg, max_positions)
            if not getattr(cls, "supports_parallel", False):
                raise ValueError(f"architecture {arch} does not support tensor or pipeline parallelism yet: "
                                 "use --tensor-parallel-size 1 --pipeline-parallel-size 1")
            return cls(cfg, max_positions, parallel=parallel)
    raise ValueError(f"unsupported architecture {archs or '(none in config.json)'}: "
                     f"supported are {sorted(ARCHITECTURES)}")
