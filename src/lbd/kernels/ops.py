"""The one place that chooses a kernel implementation.

``LBD_KERNELS`` is read once, at import. ``torch`` always runs the torch references; ``triton`` always runs
the Triton kernels (on CPU tensors that needs ``TRITON_INTERPRET=1`` set before this module is imported);
``auto`` (the default) runs Triton for CUDA tensors and, on the CPU, the C kernels of ``lbd.kernels.cpu``
when they build (fp32: decode attention, RMSNorm, neox rotary, SiLU-and-mul, the sampler's argmax; fp32 and
bf16: linear layers whose weights ``pack_linear_weights`` packed at load) and the references for the rest.
The C kernels run at the best instruction-set level the CPU has, or the one ``LBD_CPU_ISA`` caps them at
(``lbd.kernels.cpu.build``); every level runs all of them, packing from AVX2 up.
The Triton modules are imported on first use, so a CPU-only process never pays for importing triton.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

import torch

from lbd.kernels import cpu as _cpu
from lbd.kernels.cpu import packed as _packed
from lbd.kernels.metadata import AttentionMetadata
from lbd.kernels.reference import attention as _ref_attn
from lbd.kernels.reference import elementwise as _ref_elem
from lbd.kernels.reference import mla as _ref_mla
from lbd.kernels.reference import moe as _ref_moe
from lbd.kernels.reference import rotary as _ref_rotary
from lbd.kernels.rope_cache import build_rope_cache

__all__ = [
    "MODE", "argmax", "backend_for", "build_rope_cache", "linear", "pack_linear_weights", "PackedWeight",
    "rms_norm",
    "silu_and_mul", "rotary_embedding",
    "write_kv_cache", "paged_attention", "topk_softmax", "grouped_topk", "fused_experts", "fused_moe",
    "write_mla_cache", "mla_decode", "mla_prefill",
]

_MODES = ("auto", "torch", "triton")


def _read_mode() -> str:
    mode = os.environ.get("LBD_KERNELS", "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"LBD_KERNELS must be one of {_MODES}, got {mode!r}")
    return mode


MODE: str = _read_mode()
_triton_mod: ModuleType | None = None
logger = logging.getLogger(__name__)


def backend_for(device: torch.device | str) -> str:
    """'triton' or 'torch': what runs for tensors on ``device`` (for logs and the engine's startup line)."""
    if MODE == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return MODE


def _tri(t: torch.Tensor) -> ModuleType | None:
    """The Triton implementation module when it should run for tensor ``t``, else None."""
    global _triton_mod
    if MODE == "torch" or (MODE == "auto" and not t.is_cuda):
        return None
    if _triton_mod is None:
        from lbd.kernels import triton_ops

        _triton_mod = triton_ops
        logger.info("Triton kernels in use (LBD_KERNELS=%s, TRITON_INTERPRET=%s, first call on %s)", MODE,
                    os.environ.get("TRITON_INTERPRET", "0"), t.device)
    return _triton_mod


def _cpu_c(*tensors: torch.Tensor) -> bool:
    """Whether the C kernels of ``lbd.kernels.cpu`` take these (fp32, CPU) tensors."""
    return MODE == "auto" and _cpu.elementwise_ok(*tensors)


PackedWeight = _packed.PackedWeight


def linear(x: torch.Tensor, weight: torch.Tensor | PackedWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ weight[N, K]^T (+ bias). A weight packed at load (``pack_linear_weights``) runs the packed
    CPU kernel at any T; a plain one torch's GEMM (the BLAS on the CPU)."""
    if isinstance(weight, PackedWeight):
        if x.dim() != 2:
            return _packed.linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], -1)
        return _packed.linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def pack_linear_weights(model: torch.nn.Module) -> int:
    """Pack, once after loading, the weights of ``model``'s linear layers for the CPU's packed GEMM; returns
    how many were packed (0 where it does not apply: not the CPU, LBD_KERNELS=torch, no vector kernel for
    the dtype at the C kernels' level (fp32: AVX2 up; bf16: AVX-512 BF16), or the kernels did not build).

    A layer takes part when its class says ``packable_weight = True`` (its forward calls ``ops.linear`` with
    ``self.weight``): the Parameter is replaced by a ``PackedWeight`` of the same shape, so the memory is not
    doubled. A module with ``packs_tied_head = True`` (its LM head is its embedding, on one device) gets a
    packed copy of the embedding in ``lm_head_packed`` for its logits (the embedding stays for the lookup).
    """
    if MODE != "auto":
        return 0
    count = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if (getattr(module, "packable_weight", False) and isinstance(w, torch.nn.Parameter) and w.dim() == 2
                and not w.is_cuda and _packed.supported(w.dtype)):
            packed = _packed.pack(w.detach().contiguous())
            del module._parameters["weight"]
            module.weight = packed
            count += 1
        if getattr(module, "packs_tied_head", False) and module.lm_head_packed is None:
            head = module.lm_head.weight
            if not head.is_cuda and _packed.supported(head.dtype):
                module.lm_head_packed = _packed.pack(head.detach().contiguous())
                count += 1
    if count:
        logger.info("packed %d linear weights for the CPU's packed GEMM", count)
    return count


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight; with ``residual``: returns (norm(x + residual) * weight, x + residual)."""
    impl = _tri(x)
    rows = (x,) if residual is None else (x, residual)
    if impl is None and weight.dtype == torch.float32 and _cpu_c(*rows):
        return _cpu.rms_norm(x, weight, eps, residual)
    return (impl or _ref_elem).rms_norm(x, weight, eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x[T, 2I] -> silu(x[:, :I]) * x[:, I:]."""
    impl = _tri(x)
    if impl is None and x.shape[-1] % 2 == 0 and _cpu_c(x):
        return _cpu.silu_and_mul(x)
    return (impl or _ref_elem).silu_and_mul(x)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [T, V] -> int64 [T]: torch.argmax(x, dim=-1) (the first index on ties)."""
    if x.shape[-1] > 0 and _cpu_c(x):
        return _cpu.argmax(x)
    return x.argmax(dim=-1)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
                     head_dim: int, is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q[T, H*d] and k[T, Hkv*d] in place by ``cos_sin[positions]``; returns (q, k)."""
    impl = _tri(q)
    if impl is None and is_neox and cos_sin.dtype == torch.float32 and _cpu_c(q, k):
        return _cpu.rotary_neox(positions, q, k, cos_sin, head_dim)
    return (impl or _ref_rotary).rotary_embedding(positions, q, k, cos_sin, head_dim, is_neox)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store key/value [T, Hkv, d] at ``slot_mapping`` in caches [NB, BS, Hkv, d]; fp8 caches hold x/scale."""
    impl = _tri(key)
    if (impl is None and MODE == "auto" and value_cache.is_contiguous()
            and _cpu.write_ok(key, value, key_cache)):
        return _cpu.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    (impl or _ref_attn).write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of query[T, H, d] over the paged cache for a mixed decode+prefill batch."""
    impl = _tri(query)
    if impl is None and MODE == "auto" and _cpu.supports(query, key_cache):
        return _cpu.paged_attention(query, key_cache, value_cache, meta, scale)
    return (impl or _ref_attn).paged_attention(query, key_cache, value_cache, meta, scale, k_scale, v_scale)


def topk_softmax(router_logits: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing: (weights fp32 [T, k], expert ids int32 [T, k])."""
    return (_tri(router_logits) or _ref_moe).topk_softmax(router_logits, top_k, renormalize)


def grouped_topk(router_logits: torch.Tensor, top_k: int, num_groups: int, topk_groups: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's group-limited routing (sync-free torch on every device): (weights fp32, ids int32)."""
    return _ref_moe.grouped_topk(router_logits, top_k, num_groups, topk_groups, renormalize)


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts of an MoE block: hidden[T, D] with (weights, global ids) [T, k] -> [T, D], summed
    over the experts this rank holds (w13 [E_local, 2I, D], w2 [E_local, D, I]; ``expert_map[g]`` = local
    index of global expert g or -1)."""
    impl = _tri(hidden) or _ref_moe
    return impl.fused_experts(hidden, w13, w2, topk_weights, topk_ids, expert_map)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor,
              top_k: int, renormalize: bool, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """Mixture-of-experts MLP: hidden[T, D] -> [T, D]; ``expert_map[g]`` = local expert index or -1."""
    impl = _tri(hidden) or _ref_moe
    return impl.fused_moe(hidden, w13, w2, router_logits, top_k, renormalize, expert_map)


def write_mla_cache(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Store MLA latent rows [kv_c (T, L) | k_pe (T, R)] in the cache [NB, BS, L + R] (slot -1 = skip)."""
    (_tri(kv_c) or _ref_mla).write_mla_cache(kv_c, k_pe, cache, slot_mapping)


def mla_decode(query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               kv_lora_rank: int) -> torch.Tensor:
    """Weight-absorbed MLA decode of the batch's first B = query.shape[0] sequences (its decodes):
    [B, H, L + R] -> latent output [B, H, L]."""
    return (_tri(query) or _ref_mla).mla_decode(query, cache, meta, scale, kv_lora_rank)


def mla_prefill(query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, kv_b_weight: torch.Tensor,
                kv_lora_rank: int, v_head_dim: int, scale: float) -> torch.Tensor:
    """Expanded causal MLA for the sequences after the decodes: [T', H, dn + R] -> [T', H, dv] (torch SDPA
    on every device; prefill is compute-bound, so expanding the latents costs little)."""
    return _ref_mla.mla_prefill(query, cache, meta, kv_b_weight, kv_lora_rank, v_head_dim, scale)
