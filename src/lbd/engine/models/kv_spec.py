"""The shape of a model's paged KV cache (``KVSpec``): what a model with a cache of its own shape returns from
``kv_cache_spec``, and what the runner sizes and allocates the cache by (``lbd.engine.core.kv_alloc``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class KVSpec:
    """Per layer ``num_tensors`` caches of [blocks, block_size, num_kv_heads, head_dim]: K and V (2), or
    one latent cache (MLA: 1 "head" of kv_lora_rank + rope dims). A model with a cache of its own shape
    says so in ``kv_cache_spec(block_size, dtype)``; the runner builds the K/V one for the rest."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    num_tensors: int = 2

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return self.num_tensors * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token
