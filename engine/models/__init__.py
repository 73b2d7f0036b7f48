"""Model implementations over paged attention, chosen by ``config.architectures``."""

from __future__ import annotations

from typing import Any

# architecture name -> (module path, class name, qkv bias override or None = from config.attention_bias)
ARCHITECTURES: dict[str, tuple[str, str, bool | None]] = {
    "LlamaForCausalLM": ("engine.models.llama", "LlamaForCausalLM", None),
    "MistralForCausalLM": ("engine.models.llama", "LlamaForCausalLM", None),
    "Qwen2ForCausalLM": ("engine.models.llama", "LlamaForCausalLM", True),
}


def build_model(hf_config: Any, max_positions: int):
    """Our model for a transformers config, with uninitialised weights on the current default device."""
    import importlib

    from engine.models.config import arch_config

    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in ARCHITECTURES:
            module, cls_name, qkv_bias = ARCHITECTURES[arch]
            cls = getattr(importlib.import_module(module), cls_name)
            return cls(arch_config(hf_config, qkv_bias=qkv_bias), max_positions)
    raise ValueError(f"unsupported architecture {archs or '(none in config.json)'}: "
                     f"supported are {sorted(ARCHITECTURES)}")
