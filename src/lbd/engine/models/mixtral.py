"""Mixtral: Llama attention (GQA, rotary) and a sparse MoE MLP in every layer, top-2 softmax routing
renormalised over the chosen experts (transformers' ``MixtralSparseMoeBlock``)."""

from __future__ import annotations

from typing import Any

from lbd.engine.models.config import arch_config
from lbd.engine.models.moe import ExpertShard, MoECausalLM, MoEConfig, RoutingConfig


class MixtralForCausalLM(MoECausalLM):
    @classmethod
    def from_hf_config(cls, hf: Any, max_positions: int,
                       expert_shard: ExpertShard | None = None) -> MixtralForCausalLM:
        cfg = arch_config(hf)
        routing = RoutingConfig(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                                renormalize=True)
        return cls(cfg, max_positions, MoEConfig(routing, hf.intermediate_size), set(range(cfg.num_layers)),
                   expert_shard)
