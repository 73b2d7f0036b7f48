"""Qwen3 (dense) and Qwen3-MoE: Llama attention with a per-head RMSNorm of q and k before rotary and
head_dim from the config; Qwen3-MoE's MLP is a sparse MoE block except on ``mlp_only_layers`` and off the
``decoder_sparse_step`` grid, with top-k softmax routing renormalised when ``norm_topk_prob``."""

from __future__ import annotations

import dataclasses
from typing import Any

from lbd.engine.models.config import ArchConfig, arch_config
from lbd.engine.models.llama import LlamaForCausalLM
from lbd.engine.models.moe import ExpertShard, MoECausalLM, MoEConfig, RoutingConfig


def _qwen3_arch(hf: Any) -> ArchConfig:
    return dataclasses.replace(arch_config(hf), qk_norm=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    supports_parallel = False  # until the q/k norms are checked under TP

    @classmethod
    def from_hf_config(cls, hf: Any, max_positions: int) -> Qwen3ForCausalLM:
        return cls(_qwen3_arch(hf), max_positions)


def qwen3_moe_sparse_layers(hf: Any) -> set[int]:
    """transformers' rule: MoE unless listed in mlp_only_layers, on every decoder_sparse_step-th layer."""
    only_dense = set(getattr(hf, "mlp_only_layers", None) or [])
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    if not hf.num_local_experts:
        return set()
    return {i for i in range(hf.num_hidden_layers) if i not in only_dense and (i + 1) % step == 0}


class Qwen3MoeForCausalLM(MoECausalLM):
    @classmethod
    def from_hf_config(cls, hf: Any, max_positions: int,
                       expert_shard: ExpertShard | None = None) -> Qwen3MoeForCausalLM:
        routing = RoutingConfig(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                                renormalize=bool(hf.norm_topk_prob))
        return cls(_qwen3_arch(hf), max_positions, MoEConfig(routing, hf.moe_intermediate_size),
                   qwen3_moe_sparse_layers(hf), expert_shard)
