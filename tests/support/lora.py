"""Tiny random LoRA adapters in PEFT's exact on-disk format, a tiny Qwen2, and the reference: transformers
with the adapter merged into the weights (what PEFT's ``merge_and_unload`` computes: W += B A * scaling)."""

from __future__ import annotations

import json
from pathlib import Path

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def make_tiny_qwen2(
    path: Path, *, layers: int = 2, seed: int = 0, max_pos: int = 512, kv_heads: int = 2
) -> Path:
    """Qwen2: biases on q/k/v, hidden 64, 4 heads (``kv_heads`` of them KV)."""
    from transformers import Qwen2Config

    from support.tiny import _common, _save_tiny

    return _save_tiny(path, lambda tok: Qwen2Config(
        **_common(tok, layers, 64, 4, max_pos), num_key_value_heads=kv_heads, intermediate_size=128,
        use_sliding_window=False), "Qwen2ForCausalLM", seed)


def _module_shapes(cfg) -> dict[str, tuple[int, int]]:
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    q, kv, inter = heads * head_dim, cfg.num_key_value_heads * head_dim, cfg.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def make_adapter(path: Path, base: Path, *, rank: int = 8, alpha: int = 16, targets=ATTENTION + MLP,
                 seed: int = 0, scale: float = 0.15, **config: object) -> Path:
    """A random PEFT LoRA adapter for checkpoint ``base`` (both A and B random, so it changes outputs)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(base)
    shapes = _module_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module in targets:
            fan_in, fan_out = shapes[module]
            part = "self_attn" if module in ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * scale
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
                      "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": list(targets),
                      "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None,
                      "fan_in_fan_out": False, "init_lora_weights": True, "layers_to_transform": None,
                      "rank_pattern": {}, "alpha_pattern": {}}
    adapter_config.update(config)
    (path / "adapter_config.json").write_text(json.dumps(adapter_config))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def merged_checkpoint(base: Path, adapter: Path, out: Path) -> Path:
    """``base`` with ``adapter`` merged in (W += B A * lora_alpha / r), saved to ``out`` for transformers."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scaling = cfg["lora_alpha"] / cfg["r"]
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in lora.items():
            if ".lora_A." not in name:
                continue
            b = lora[name.replace(".lora_A.", ".lora_B.")]
            target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            params[target] += (b @ a) * scaling
    model.save_pretrained(out)
    return out
