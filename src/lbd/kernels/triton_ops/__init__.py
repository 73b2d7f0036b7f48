"""Triton kernels, one module per family; same call signatures as ``lbd.kernels.reference``.

Importing this package imports triton, so ``ops`` does it lazily. Every launch is graph-capturable:
grids and buffers depend only on tensor shapes and host ints in the metadata, never on device data.
"""

from lbd.kernels.triton_ops.attention import paged_attention
from lbd.kernels.triton_ops.elementwise import rms_norm, silu_and_mul
from lbd.kernels.triton_ops.kv_cache import write_kv_cache
from lbd.kernels.triton_ops.mla import mla_decode, write_mla_cache
from lbd.kernels.triton_ops.moe import fused_experts, fused_moe, topk_softmax
from lbd.kernels.triton_ops.rotary import rotary_embedding

__all__ = ["fused_experts", "fused_moe", "mla_decode", "paged_attention", "rms_norm", "rotary_embedding",
           "silu_and_mul", "topk_softmax", "write_kv_cache", "write_mla_cache"]
