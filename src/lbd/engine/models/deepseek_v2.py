"""DeepSeek-V2 (and V2-Lite): MLA attention over a latent KV cache, and DeepSeek-MoE MLPs (routed experts
with greedy or group-limited top-k, ``routed_scaling_factor``, shared experts) from layer
``first_k_dense_replace`` on, every ``moe_layer_freq``-th layer; dense MLPs before.

Routing follows transformers 5.24's ``DeepseekV2TopkRouter``: fp32 gate, softmax scores, top-k (optionally
within the best ``topk_group`` of ``n_group`` groups), weights times ``routed_scaling_factor`` and never
renormalised. (transformers ignores ``norm_topk_prob`` for V2; the released V2 checkpoints set it false.
It also ignores ``moe_layer_freq``, which is 1 in every released checkpoint; we honour it as DeepSeek's
own code does.)
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from lbd.engine.models.config import arch_config
from lbd.engine.models.kv_spec import KVSpec
from lbd.engine.models.mla import MLAConfig, MLAttention
from lbd.engine.models.moe import ExpertShard, MoECausalLM, MoEConfig, RoutingConfig

logger = logging.getLogger(__name__)

TOPK_METHODS = ("greedy", "group_limited_greedy")


def deepseek_moe(hf: Any) -> tuple[MoEConfig, set[int]]:
    """The MoE block and the layers that have one."""
    method = hf.topk_method or "greedy"
    if method not in TOPK_METHODS:
        raise ValueError(f"DeepSeek topk_method {method!r} is not supported: use one of {TOPK_METHODS} "
                         "(DeepSeek-V3's noaux_tc is not implemented)")
    grouped = method == "group_limited_greedy"
    if grouped and not (hf.n_group and hf.topk_group):
        raise ValueError("topk_method group_limited_greedy needs n_group and topk_group in config.json")
    if getattr(hf, "norm_topk_prob", False):
        logger.warning("DeepSeek-V2 config sets norm_topk_prob; like transformers, routing weights are not "
                       "renormalised")
    routing = RoutingConfig(num_experts=hf.n_routed_experts, top_k=hf.num_experts_per_tok, renormalize=False,
                            grouped=grouped, num_groups=int(hf.n_group or 1),
                            topk_groups=int(hf.topk_group or 1),
                            scaling_factor=float(hf.routed_scaling_factor), fp32_logits=True)
    shared = hf.moe_intermediate_size * (hf.n_shared_experts or 0)
    freq = int(getattr(hf, "moe_layer_freq", 1) or 1)
    sparse = set()
    if hf.n_routed_experts:
        sparse = {i for i in range(hf.num_hidden_layers) if i >= hf.first_k_dense_replace and i % freq == 0}
    return MoEConfig(routing, hf.moe_intermediate_size, shared), sparse


class DeepseekV2ForCausalLM(MoECausalLM):
    supports_fp8_kv_cache = False

    def __init__(self, cfg: Any, max_positions: int, moe: MoEConfig, sparse_layers: set[int], mla: MLAConfig,
                 expert_shard: ExpertShard | None = None) -> None:
        super().__init__(cfg, max_positions, moe, sparse_layers, expert_shard,
                         make_attn=lambda _: MLAttention(cfg.hidden_size, mla))
        self.mla = mla

    @classmethod
    def from_hf_config(cls, hf: Any, max_positions: int,
                       expert_shard: ExpertShard | None = None) -> DeepseekV2ForCausalLM:
        # Rotary covers only the rope part of each head; heads/kv-heads in the Llama sense do not apply.
        cfg = arch_config(hf)
        cfg = dataclasses.replace(cfg, head_dim=hf.qk_rope_head_dim, rotary_dim=hf.qk_rope_head_dim,
                                  num_kv_heads=1)
        moe, sparse = deepseek_moe(hf)
        return cls(cfg, max_positions, moe, sparse, MLAConfig.from_hf_config(hf, cfg.rope_scaling),
                   expert_shard)

    @property
    def attention_layers(self) -> list[MLAttention]:
        return [layer.self_attn for layer in self.model.layers]

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVSpec:
        """One latent row per token per layer: [blocks, block_size, kv_lora_rank + qk_rope_head_dim]."""
        return KVSpec(self.cfg.num_layers, 1, self.mla.latent_dim, block_size, dtype, num_tensors=1)

    def mha_kv_elements_per_token(self) -> int:
        """What an MHA cache of this model would hold per token: every head's K (nope + rope) and V."""
        m = self.mla
        return self.cfg.num_layers * m.num_heads * (m.qk_head_dim + m.v_head_dim)
