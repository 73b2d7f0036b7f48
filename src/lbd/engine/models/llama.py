"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2) over a flat packed batch and a paged KV cache.

Every token of a step (decodes and prefill chunks of many sequences) is one row of a [T, D] matrix, so each
projection is one matmul for the whole batch; attention reads all keys from the paged cache through
``AttentionMetadata``. All math beyond the matmuls goes through ``lbd.kernels.ops``.

Tensor/pipeline parallel (``parallel``, see ``models.parallel``): each worker builds its TP shard of
its pipeline stage's layers only (the others are ``Absent``); the first stage embeds, the last one normalises
and computes logits, and stages in between take and return the (hidden, residual) pair.

On the CPU in fp32, a model made only of the plain layers below (no biases, no per-head norms, one device)
runs its whole decoder stack as one C call (``lbd.kernels.cpu.decoder``): the same kernels with the same
arguments, so the same numbers, without ten Python calls per layer. ``LBD_FUSED_DECODER=0`` turns that off
(to measure one against the other).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

from lbd.engine.distributed.context import ParallelContext
from lbd.engine.models import parallel as par
from lbd.engine.models.config import ArchConfig
from lbd.engine.models.layers import RMSNorm
from lbd.kernels import ops
from lbd.kernels.cpu import decoder as fused
from lbd.kernels.cpu.packed import PackedWeight
from lbd.kernels.metadata import AttentionMetadata

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
        # the logits may read a packed copy of the embedding (ops.pack_linear_weights): only where the head
        # is the one-device embedding itself (a separate head is a Linear and packs by itself)
        self.packs_tied_head = ctx.tp_size == 1 and self.lm_head is self.model.embed_tokens
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
            decoder = self.fused_decoder()
            cache = kv_caches[0][0] if kv_caches else None
            if self.lora_ctx is not None and self.lora_ctx.step is not None:
                decoder = None  # adapted tokens: the layer-by-layer forward, whose projections add LoRA
            if (decoder is not None and cache is not None and cache.dtype == torch.float32
                    and cache.is_contiguous() and fused.usable(meta, x.shape[0])):
                return decoder.forward(x, positions, meta, kv_caches)
        else:
            x, residual = carry
        for layer, kv_cache in zip(self.model.local_layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, meta, kv_cache, self.cos_sin)
        if not self.parallel.is_last_stage:
            return x, residual
        x, _ = self.model.norm(x, residual)
        return x

    _fused: fused.FusedDecoder | None = None
    _fused_checked = False
    lora_ctx = None  # under --enable-lora, the step's adapters (lbd.engine.lora.slots.LoraContext)

    def fused_decoder(self) -> fused.FusedDecoder | None:
        """The whole stack as one C call, where every layer is the plain fp32 kind the C driver chains (built
        once, after the weights were packed); else None (the layer-by-layer forward)."""
        if not self._fused_checked:
            self._fused_checked = True
            self._fused = self._build_fused() if os.environ.get("LBD_FUSED_DECODER", "1") != "0" else None
        return self._fused

    def _build_fused(self) -> fused.FusedDecoder | None:
        ctx = self.parallel
        one_device = ctx.tp_size == 1 and ctx.is_first_stage and ctx.is_last_stage
        if not one_device or self.cos_sin.dtype != torch.float32:
            return None
        weights = []
        for layer in self.model.local_layers:
            plain = (type(layer) is DecoderLayer and type(layer.self_attn) is Attention
                     and type(layer.mlp) is MLP)
            if not plain:
                return None
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if (attn.q_norm is not None or attn.k_scale != 1.0 or attn.v_scale != 1.0
                    or any(lin.bias is not None or not isinstance(lin.weight, PackedWeight)
                           or lin.weight.dtype != torch.float32 for lin in linears)):
                return None
            weights.append(fused.LayerWeights(layer.input_layernorm.weight, attn.qkv_proj.weight,
                                              attn.o_proj.weight, layer.post_attention_layernorm.weight,
                                              mlp.gate_up_proj.weight, mlp.down_proj.weight))
        if not weights:
            return None
        attn, cfg = self.model.local_layers[0].self_attn, self.cfg
        dims = fused.DecoderDims(cfg.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                 weights[0].down.in_features, self.cos_sin.shape[1], cfg.rms_norm_eps,
                                 attn.scale)
        return fused.FusedDecoder(dims, weights, self.model.norm.weight, self.cos_sin)

    lm_head_packed: ops.PackedWeight | None = None  # the tied embedding packed for the logits (CPU, TP = 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, D] (only the rows that sample) -> logits [N, V]; with TP, on TP rank 0 only (None on
        the others)."""
        if self.parallel.tp_size > 1:
            return par.vocab_logits(hidden, self.lm_head)
        head = self.lm_head.weight if self.lm_head_packed is None else self.lm_head_packed
        return ops.linear(hidden, head)
