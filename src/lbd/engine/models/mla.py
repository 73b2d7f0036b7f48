"""DeepSeek-V2's multi-head latent attention over a paged cache of compressed latents.

Per token the cache keeps what ``kv_a_proj_with_mqa`` makes of it: the normalised latent c_kv
(kv_lora_rank values) and the rotated rope key k_pe shared by all heads (qk_rope_head_dim values), as
vLLM's MLA backends do; per-head keys and values are never stored. Decodes use the weight-absorbed form:
q_nope is folded through W_UK (the key half of ``kv_b_proj``) into latent space, attention runs over the
latent rows, and the latent output leaves through W_UV (the value half). Prefill chunks expand their
sequence's latents with ``kv_b_proj`` and attend in ordinary form. Both forms compute the same function.

Rotary follows DeepSeek's layout (pairs of adjacent dims, transformers' ``apply_rotary_emb``), on q_pe and
k_pe only; the softmax scale is qk_head_dim^-0.5 times yarn's mscale(factor, mscale_all_dim)^2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lbd.engine.models.layers import Linear, RMSNorm
from lbd.kernels import ops
from lbd.kernels.metadata import AttentionMetadata

# transformers builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps, not config.rms_norm_eps
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class MLAConfig:
    num_heads: int
    q_lora_rank: int | None  # None: one q_proj (DeepSeek-V2-Lite); else q_a_proj -> norm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    scale: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token per layer in the cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf_config(cls, hf: Any, rope_scaling: dict | None) -> MLAConfig:
        qk_head_dim = hf.qk_nope_head_dim + hf.qk_rope_head_dim
        scale = qk_head_dim**-0.5
        mscale_all_dim = (rope_scaling or {}).get("mscale_all_dim")
        if rope_scaling and mscale_all_dim:
            factor = float(rope_scaling["factor"])
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale *= mscale * mscale
        return cls(num_heads=hf.num_attention_heads, q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
                   qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim,
                   v_head_dim=hf.v_head_dim, attention_bias=bool(getattr(hf, "attention_bias", False)),
                   scale=scale)


class MLAttention(nn.Module):
    """Checkpoint names as transformers' ``DeepseekV2Attention``."""

    def __init__(self, hidden_size: int, mla: MLAConfig) -> None:
        super().__init__()
        self.mla = mla
        heads, bias = mla.num_heads, mla.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden_size, heads * mla.qk_head_dim)
        else:
            self.q_a_proj = Linear(hidden_size, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, heads * mla.qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(hidden_size, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim))
        self.kv_b_proj.packable_weight = False  # read as a matrix (the absorbed W_UK, W_UV views): plain
        self.o_proj = Linear(heads * mla.v_head_dim, hidden_size, bias=bias)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.mla.num_heads, self.mla.qk_head_dim)

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, dn, L] and W_UV [H, dv, L]: views of kv_b_proj's weight."""
        m = self.mla
        w = self.kv_b_proj.weight.view(m.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, cache: torch.Tensor,
                cos_sin: torch.Tensor) -> torch.Tensor:
        m = self.mla
        t, heads, nope, rope = x.shape[0], m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim
        q = self._query(x)
        latent = self.kv_a_proj_with_mqa(x)
        kv_c = self.kv_a_layernorm(latent[:, :m.kv_lora_rank])
        k_pe = latent[:, m.kv_lora_rank:].contiguous()
        q_pe = q[..., nope:].reshape(t, heads * rope)  # a copy: rotated in place below
        q_pe, k_pe = ops.rotary_embedding(positions, q_pe, k_pe, cos_sin, rope, is_neox=False)
        q_pe = q_pe.view(t, heads, rope)
        ops.write_mla_cache(kv_c, k_pe, cache, meta.slot_mapping)
        out = x.new_empty(t, heads, m.v_head_dim)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd, :, :nope], q_pe[:nd], cache, meta)
        if t > nd:
            query = torch.cat([q[nd:, :, :nope], q_pe[nd:]], dim=-1)
            out[nd:] = ops.mla_prefill(query, cache, meta, self.kv_b_proj.weight, m.kv_lora_rank,
                                       m.v_head_dim, m.scale)
        return self.o_proj(out.view(t, heads * m.v_head_dim))

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """[B, H, dn] + [B, H, R] -> [B, H, dv] through the latent space."""
        w_uk, w_uv = self._absorbed_weights()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, L]
        o_lat = ops.mla_decode(torch.cat([q_lat, q_pe], dim=-1), cache, meta, self.mla.scale,
                               self.mla.kv_lora_rank)
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
