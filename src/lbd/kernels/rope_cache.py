"""Rotary cos/sin cache construction (pure torch, shared by every backend).

Follows the Hugging Face ``rope_scaling`` / ``rope_parameters`` conventions so that a model served here
rotates exactly as ``transformers`` does: inverse frequencies are computed in fp32 the same way, and the
per-type scaling formulas match ``transformers.modeling_rope_utils``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

RopeFn = Callable[[int, int, float, dict, torch.device], tuple[torch.Tensor, float]]


def _base_inv_freq(dim: int, base: float, device: torch.device) -> torch.Tensor:
    exps = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
    return 1.0 / (base**exps)


def _original_max(scaling: dict, max_position: int) -> int:
    return int(scaling.get("original_max_position_embeddings") or max_position)


def _default(dim: int, max_pos: int, base: float, scaling: dict, device: torch.device):
    inv = _base_inv_freq(dim, base, device)
    return torch.arange(max_pos, device=device, dtype=torch.float32)[:, None] * inv[None, :], 1.0


def _linear(dim: int, max_pos: int, base: float, scaling: dict, device: torch.device):
    inv = _base_inv_freq(dim, base, device) / float(scaling["factor"])
    return torch.arange(max_pos, device=device, dtype=torch.float32)[:, None] * inv[None, :], 1.0


def _dynamic(dim: int, max_pos: int, base: float, scaling: dict, device: torch.device):
    """Dynamic NTK: past the original context the base grows with the sequence length.

    transformers recomputes the base from the current length on every forward; during generation each new
    token is rotated with the base for (its position + 1). A static per-position cache reproduces that exactly
    for decoding and for any prompt that fits the original context.
    """
    factor = float(scaling["factor"])
    orig = _original_max(scaling, max_pos)
    pos = torch.arange(max_pos, device=device, dtype=torch.float32)
    seq_len = torch.clamp(pos + 1, min=orig)
    grown = base * ((factor * seq_len / orig) - (factor - 1)) ** (dim / (dim - 2))
    exps = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
    inv = 1.0 / (grown[:, None] ** exps[None, :])
    inv = torch.where((pos + 1 <= orig)[:, None], _base_inv_freq(dim, base, device)[None, :], inv)
    return pos[:, None] * inv, 1.0


def _llama3(dim: int, max_pos: int, base: float, scaling: dict, device: torch.device):
    factor = float(scaling["factor"])
    low_ff = float(scaling.get("low_freq_factor", 1.0))
    high_ff = float(scaling.get("high_freq_factor", 4.0))
    orig = _original_max(scaling, max_pos)
    inv = _base_inv_freq(dim, base, device)
    low_wavelen = orig / low_ff
    high_wavelen = orig / high_ff
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (orig / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv = torch.where(medium, smoothed, scaled)
    return torch.arange(max_pos, device=device, dtype=torch.float32)[:, None] * inv[None, :], 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(scale) + 1.0 if scale > 1 else 1.0


def _yarn(dim: int, max_pos: int, base: float, scaling: dict, device: torch.device):
    orig = _original_max(scaling, max_pos)
    factor = float(scaling.get("factor") or max_pos / orig)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)
    attn = scaling.get("attention_factor")
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attn is None:
        if mscale and mscale_all:
            attn = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attn = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)
    extrapolate = 1 - ramp.clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return torch.arange(max_pos, device=device, dtype=torch.float32)[:, None] * inv[None, :], float(attn)


_ROPE_TYPES: dict[str, RopeFn] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
}


def rope_type_of(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def build_rope_cache(rotary_dim: int, max_position: int, base: float, scaling: dict | None,
                     dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """cos_sin[max_position, rotary_dim]: the first rotary_dim/2 columns are cos, the rest sin.

    ``scaling`` is the HF ``rope_scaling`` (or 5.x ``rope_parameters``) dict; extra keys such as
    ``rope_theta`` are ignored. ``original_max_position_embeddings`` in it (falling back to
    ``max_position``) is the pre-scaling context length.
    """
    if rotary_dim % 2 or rotary_dim <= 0:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    kind = rope_type_of(scaling)
    fn = _ROPE_TYPES.get(kind)
    if fn is None:
        raise ValueError(f"unsupported rope_type {kind!r}; supported: {sorted(_ROPE_TYPES)}")
    freqs, attn_factor = fn(rotary_dim, max_position, float(base), dict(scaling or {}), torch.device(device))
    cos_sin = torch.cat([freqs.cos() * attn_factor, freqs.sin() * attn_factor], dim=-1)
    return cos_sin.to(dtype).contiguous()
