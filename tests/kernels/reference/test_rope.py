"""build_rope_cache against transformers' RoPE init functions; the rotary reference against HF's formula."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from lbd.kernels.reference.rotary import rotary_embedding
from lbd.kernels.rope_cache import build_rope_cache

SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "beta_fast": 16,
     "mscale": 1.0, "mscale_all_dim": 0.5},
]


def _hf_cos_sin(scaling: dict | None, head_dim: int, max_pos: int, base: float,
                positions: torch.Tensor) -> torch.Tensor:
    params = {"rope_theta": base, "rope_type": "default", **(scaling or {})}
    cfg = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, max_position_embeddings=max_pos,
                      rope_parameters=params)
    kind = params["rope_type"]
    if kind == "default":
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        attn = 1.0
    elif kind == "dynamic":
        # transformers rotates a decoded token with the base for seq_len = its position + 1
        rows = [ROPE_INIT_FUNCTIONS[kind](cfg, None, seq_len=int(p) + 1)[0] for p in positions]
        freqs = positions.float()[:, None] * torch.stack(rows)
        return torch.cat([freqs.cos(), freqs.sin()], -1)
    else:
        inv, attn = ROPE_INIT_FUNCTIONS[kind](cfg, None)
    freqs = positions.float()[:, None] * inv[None, :]
    return torch.cat([freqs.cos() * attn, freqs.sin() * attn], -1)


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: (s or {}).get("rope_type", "default"))
def test_cache_matches_transformers(scaling: dict | None) -> None:
    max_pos, head_dim, base = 256, 64, 10000.0
    positions = torch.tensor([0, 1, 5, 31, 32, 63, 64, 65, 100, 255])
    if (scaling or {}).get("rope_type") == "dynamic":
        # transformers reads the original context from config.max_position_embeddings, we from the dict
        want = _hf_cos_sin(scaling, head_dim, 64, base, positions)
        scaling = {**scaling, "original_max_position_embeddings": 64}
    else:
        want = _hf_cos_sin(scaling, head_dim, max_pos, base, positions)
    ours = build_rope_cache(head_dim, max_pos, base, scaling, torch.float32, "cpu")
    assert ours.shape == (max_pos, head_dim)
    torch.testing.assert_close(ours[positions], want, rtol=1e-5, atol=1e-5)


def test_unknown_rope_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="rope_type"):
        build_rope_cache(64, 16, 10000.0, {"rope_type": "su-perb", "factor": 2.0}, torch.float32, "cpu")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _dense_rotary(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor,
                  is_neox: bool) -> torch.Tensor:
    """transformers' neox formula; GPT-J by de-interleaving pairs, rotating, interleaving back."""
    rd = cos_sin.shape[1]
    cos, sin = cos_sin[positions].chunk(2, -1)
    cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    rot, rest = x[..., :rd], x[..., rd:]
    if not is_neox:
        rot = torch.cat([rot[..., 0::2], rot[..., 1::2]], -1)
    out = rot * cos + _rotate_half(rot) * sin
    if not is_neox:
        out = torch.stack([out[..., : rd // 2], out[..., rd // 2 :]], -1).flatten(-2)
    return torch.cat([out, rest], -1)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (80, 80), (128, 64), (96, 32)])
def test_rotary_matches_dense(is_neox: bool, head_dim: int, rotary_dim: int) -> None:
    g = torch.Generator().manual_seed(3)
    t, h, hkv = 7, 4, 2
    cos_sin = build_rope_cache(rotary_dim, 128, 10000.0, {"rope_type": "llama3", "factor": 8.0,
                               "original_max_position_embeddings": 32}, torch.float32, "cpu")
    positions = torch.tensor([0, 3, 17, 64, 127, 1, 2])
    q = torch.randn(t, h * head_dim, generator=g)
    k = torch.randn(t, hkv * head_dim, generator=g)
    want_q = _dense_rotary(q.view(t, h, head_dim), cos_sin, positions, is_neox).view(t, -1)
    want_k = _dense_rotary(k.view(t, hkv, head_dim), cos_sin, positions, is_neox).view(t, -1)
    out_q, out_k = rotary_embedding(positions, q, k, cos_sin, head_dim, is_neox)
    torch.testing.assert_close(out_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_k, want_k, rtol=1e-5, atol=1e-5)


def test_rotary_on_strided_qkv_split() -> None:
    """q and k as column slices of one fused qkv output (what a model passes) rotate in place."""
    g = torch.Generator().manual_seed(4)
    t, h, hkv, d = 5, 4, 2, 64
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    cos_sin = build_rope_cache(d, 64, 10000.0, None, torch.float32, "cpu")
    positions = torch.arange(t) * 3
    want_q = _dense_rotary(q.reshape(t, h, d), cos_sin, positions, True).reshape(t, -1)
    v_before = v.clone()
    out_q, _ = rotary_embedding(positions, q, k, cos_sin, d, True)
    torch.testing.assert_close(out_q, want_q, rtol=1e-5, atol=1e-5)
    assert torch.equal(v, v_before)
