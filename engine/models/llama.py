"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2) over a flat packed batch and a paged KV cache.

Every token of a step (decodes and prefill chunks of many sequences) is one row of a [T, D] matrix, so each
projection is one matmul for the whole batch; attention reads all keys from the paged cache through
``AttentionMetadata``. All math beyond the matmuls goes through ``kernels.ops``.

Tensor/pipeline parallel (``parallel``, see ``engine.models.parallel``): each worker builds its TP shard of
its pipeline stage's layers only (the others are ``Absent``); the first stage embeds, the last one normalises
and computes logits, and stages in between take and return the (hidden, residual) pair.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.distributed.context import ParallelContext
from engine.models import parallel as par
from engine.models.config import ArchConfig
from engine.models.layers import RMSNorm
from kernels import ops
from kernels.metadata import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]  # key_cache, value_cache: [num_blocks, block_size, Hkv, d]
Carry = tuple[torch.Tensor, torch.Tensor]  # (hidden, residual) between pipeline stages


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, ctx: ParallelContext | None = None) -> None:
        super().__init__()
        ctx = ctx or ParallelContext.single()
        self.num_heads = cfg.num_heads // ctx.tp_size  # this rank's heads
        self.num_kv_heads = par.kv_heads_per_rank(cfg.num_kv_heads, ctx.tp_size)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = par.qkv_linear(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                       cfg.qkv_bias, ctx)
        self.o_proj = par.row_linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, ctx)
        # Qwen3: RMSNorm over each head's q and k before rotary
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        # fp8 KV cache: stored value = x / scale. Plain floats so the kernels get no tensor to sync on.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache,
                cos_sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(t, self.q_size)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(t, self.kv_size)
        q, k = ops.rotary_embedding(positions, q, k, cos_sin, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        ops.write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        out = ops.paged_attention(q.view(t, self.num_heads, self.head_dim), key_cache, value_cache, meta,
                                  self.scale, self.k_scale, self.v_scale)
        return self.o_proj(out.view(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig, intermediate_size: int | None = None,
                 ctx: ParallelContext | None = None) -> None:
        super().__init__()
        ctx = ctx or ParallelContext.single()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = par.merged_linear(cfg.hidden_size, [inter, inter], cfg.mlp_bias, ctx)
        self.down_proj = par.row_linear(inter, cfg.hidden_size, cfg.mlp_bias, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP; other models pass their own attention (MLA) or MLP (an MoE block)."""

    def __init__(self, cfg: ArchConfig, self_attn: nn.Module | None = None, mlp: nn.Module | None = None,
                 ctx: ParallelContext | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, ctx) if self_attn is None else self_attn
        self.mlp = MLP(cfg, ctx=ctx) if mlp is None else mlp
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


LayerFactory = Callable[[int], nn.Module]  # layer index -> decoder layer


class LlamaModel(nn.Module):
    """Embedding, layers, final norm; with pipeline stages, what another stage holds is ``Absent`` (its
    layers keep their indices, so checkpoint names still match); ``make_layer`` builds local layers only."""

    def __init__(self, cfg: ArchConfig, make_layer: LayerFactory | None = None,
                 ctx: ParallelContext | None = None) -> None:
        super().__init__()
        ctx = ctx or ParallelContext.single()
        start, end = ctx.layer_range(cfg.num_layers)
        self.embed_tokens = par.embedding(cfg.vocab_size, cfg.hidden_size, ctx) if ctx.is_first_stage \
            else par.Absent()
        make_layer = make_layer or (lambda _: DecoderLayer(cfg, ctx=ctx))
        self.layers = nn.ModuleList(make_layer(i) if start <= i < end else par.Absent()
                                    for i in range(cfg.num_layers))
        self.local_layers = list(self.layers[start:end])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if ctx.is_last_stage else par.Absent()


class LlamaForCausalLM(nn.Module):
    """Checkpoint names match transformers' except the fused ``qkv_proj`` and ``gate_up_proj``."""

    supports_parallel = True

    def __init__(self, cfg: ArchConfig, max_positions: int, make_layer: LayerFactory | None = None,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__()
        ctx = parallel or ParallelContext.single()
        self.cfg = cfg
        self.parallel = ctx
        self.tie_word_embeddings = cfg.tie_word_embeddings
        self.model = LlamaModel(cfg, make_layer, ctx)
        # checkpoint tensor -> more of our parameters it fills (a tied LM head on another stage than the
        # embedding)
        self.checkpoint_aliases: dict[str, list[str]] = {}
        if not ctx.is_last_stage:
            self.lm_head: nn.Module = par.Absent()
        elif cfg.tie_word_embeddings and ctx.is_first_stage:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = par.lm_head(cfg.vocab_size, cfg.hidden_size, ctx)
            if cfg.tie_word_embeddings:
                self.checkpoint_aliases["model.embed_tokens.weight"] = ["lm_head.weight"]
        self.max_positions = max_positions
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)

    def init_rope(self, device: torch.device) -> None:
        """Build the cos/sin table (fp32, like transformers) once the model sits on its device."""
        cfg = self.cfg
        self.cos_sin = ops.build_rope_cache(cfg.rotary_dim, self.max_positions, cfg.rope_theta,
                                            cfg.rope_scaling, torch.float32, device)

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.local_layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], carry: Carry | None = None) -> torch.Tensor | Carry:
        """input_ids/positions [T] -> final hidden states [T, D] (normed). A pipeline stage after the first
        takes ``carry`` (hidden, residual) instead of embedding; one before the last returns its carry."""
        if carry is None:
            x = self.model.embed_tokens(input_ids)
            residual = None
        else:
            x, residual = carry
        for layer, kv_cache in zip(self.model.local_layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, meta, kv_cache, self.cos_sin)
        if not self.parallel.is_last_stage:
            return x, residual
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, D] (only the rows that sample) -> logits [N, V]; with TP, on TP rank 0 only (None on
        the others)."""
        if self.parallel.tp_size > 1:
            return par.vocab_logits(hidden, self.lm_head)
        return ops.linear(hidden, self.lm_head.weight)
