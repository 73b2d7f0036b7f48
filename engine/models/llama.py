"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over a flat packed batch and a paged KV cache.

Every token of a step (decodes and prefill chunks of many sequences) is one row of a [T, D] matrix, so each
projection is one matmul for the whole batch; attention reads all keys from the paged cache through
``AttentionMetadata``. All math beyond the matmuls goes through ``kernels.ops``.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.config import ArchConfig
from engine.models.layers import Embedding, Linear, RMSNorm
from kernels import ops
from kernels.metadata import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]  # key_cache, value_cache: [num_blocks, block_size, Hkv, d]


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.head_dim**-0.5
        # fp8 KV cache: stored value = x / scale. Plain floats so the kernels get no tensor to sync on.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.calibrating = False
        self.k_amax = 0.0
        self.v_amax = 0.0

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache,
                cos_sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = ops.rotary_embedding(positions, q, k, cos_sin, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.calibrating:
            self.k_amax = max(self.k_amax, float(k.abs().max()))
            self.v_amax = max(self.v_amax, float(v.abs().max()))
        key_cache, value_cache = kv_cache
        ops.write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        out = ops.paged_attention(q.view(t, self.num_heads, self.head_dim), key_cache, value_cache, meta,
                                  self.scale, self.k_scale, self.v_scale)
        return self.o_proj(out.view(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, [inter, inter], bias=cfg.mlp_bias)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, kv_cache: KVCache,
                cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm fuses the preceding residual add.
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta, kv_cache, cos_sin)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Checkpoint names match transformers' except the fused ``qkv_proj`` and ``gate_up_proj``."""

    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.tie_word_embeddings = cfg.tie_word_embeddings
        self.model = LlamaModel(cfg)
        self.lm_head = self.model.embed_tokens if cfg.tie_word_embeddings else Linear(cfg.hidden_size,
                                                                                        cfg.vocab_size)
        self.max_positions = max_positions
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)

    def init_rope(self, device: torch.device) -> None:
        """Build the cos/sin table (fp32, like transformers) once the model sits on its device."""
        cfg = self.cfg
        self.cos_sin = ops.build_rope_cache(cfg.rotary_dim, self.max_positions, cfg.rope_theta,
                                            cfg.rope_scaling, torch.float32, device)

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache]) -> torch.Tensor:
        """input_ids/positions [T] -> final hidden states [T, D] (normed)."""
        x = self.model.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, meta, kv_cache, self.cos_sin)
        x, _ = self.model.norm(x, residual)
        return x

    lm_head_packed: ops.PackedWeight | None = None  # the tied embedding packed for the logits (CPU)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] (only the rows that sample) -> logits [N, V]."""
        head = self.lm_head.weight if self.lm_head_packed is None else self.lm_head_packed
        return ops.linear(hidden, head)
