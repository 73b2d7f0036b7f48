"""Triton RMSNorm, SiLU-and-mul, rotary and KV-cache write against the torch references (interpreter on CPU).

Tolerances: fp32 rtol/atol 1e-4 (at most), fp16 1e-2. Outputs are NaN-poisoned first: a missed element fails.
"""

from __future__ import annotations

import pytest
import torch

from lbd.kernels import triton_ops as tri
from lbd.kernels.reference import attention as ref_attn
from lbd.kernels.reference import elementwise as ref
from lbd.kernels.reference import rotary as ref_rot
from lbd.kernels.rope_cache import build_rope_cache
from lbd.kernels.triton_ops import fp8

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=1e-2, atol=1e-2)}
DTYPES = [torch.float32, torch.float16]


def _rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _poison(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(tuple(shape), float("nan"), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 100])
def test_rms_norm(dtype: torch.dtype, dim: int) -> None:
    big = _rand(6, dim + 8, dtype=dtype, seed=1)
    x = big[:, :dim]  # strided rows, as a slice of a wider activation
    w = (torch.rand(dim, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype)
    out = tri.rms_norm(x, w, 1e-5, out=_poison(x.shape, dtype))
    torch.testing.assert_close(out, ref.rms_norm(x, w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fused_residual(dtype: torch.dtype) -> None:
    x, r = _rand(5, 96, dtype=dtype, seed=3), _rand(5, 96, dtype=dtype, seed=4)
    w = (torch.rand(96, generator=torch.Generator().manual_seed(5)) + 0.5).to(dtype)
    out, res = tri.rms_norm(x, w, 1e-6, r, out=_poison(x.shape, dtype), residual_out=_poison(x.shape, dtype))
    want_out, want_res = ref.rms_norm(x, w, 1e-6, residual=r)
    torch.testing.assert_close(res, want_res, **TOL[dtype])
    torch.testing.assert_close(out, want_out, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [48, 1100])
def test_silu_and_mul(dtype: torch.dtype, inter: int) -> None:
    x = _rand(3, 2 * inter, dtype=dtype, seed=6) * 3
    out = tri.silu_and_mul(x, out=_poison((3, inter), dtype))
    torch.testing.assert_close(out, ref.silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim,rotary_dim,scaling", [
    (64, 64, None),
    (80, 80, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    (128, 64, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32}),
    (96, 48, {"rope_type": "linear", "factor": 2.0}),
])
def test_rotary(dtype: torch.dtype, is_neox: bool, head_dim: int, rotary_dim: int,
                scaling: dict | None) -> None:
    t, h, hkv = 6, 3, 1
    cos_sin = build_rope_cache(rotary_dim, 200, 10000.0, scaling, dtype, "cpu")
    positions = torch.tensor([0, 7, 31, 32, 150, 199])
    qkv = _rand(t, (h + 2 * hkv) * head_dim, dtype=dtype, seed=7)
    q, k, v = qkv.split([h * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    want_q, want_k = ref_rot.rotary_embedding(positions, q.clone(), k.clone(), cos_sin, head_dim, is_neox)
    v_before = v.clone()
    got_q, got_k = tri.rotary_embedding(positions, q, k, cos_sin, head_dim, is_neox)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("software_fp8", [False, True], ids=["native", "bytes"])
@pytest.mark.parametrize("cache_dtype,act_dtype,scales", [
    (torch.float32, torch.float32, (1.0, 1.0)),
    (torch.float16, torch.float16, (1.0, 1.0)),
    (torch.float8_e4m3fn, torch.float16, (0.05, 2.0)),
    (torch.float8_e4m3fn, torch.float32, (1.0, 0.5)),
])
def test_write_kv_cache(cache_dtype: torch.dtype, act_dtype: torch.dtype, scales: tuple[float, float],
                        software_fp8: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if software_fp8 and cache_dtype != torch.float8_e4m3fn:
        pytest.skip("the byte path only exists for fp8 caches")
    monkeypatch.setattr(fp8, "force_software", software_fp8)  # sm_80-style e4m3 done in integer arithmetic
    nb, bs, hkv, d = 7, 4, 2, 80
    kv = _rand(6, 2 * hkv, d, dtype=act_dtype, seed=8) * 4
    key, value = kv[:, :hkv], kv[:, hkv:]  # strided views, as split from a fused projection
    slots = torch.tensor([9, -1, 27, 0, -1, 14])
    caches = [_poison((nb, bs, hkv, d), cache_dtype) for _ in range(4)]
    ref_attn.write_kv_cache(key, value, caches[0], caches[1], slots, *scales)
    tri.write_kv_cache(key, value, caches[2], caches[3], slots, *scales)
    torch.testing.assert_close(caches[2].float(), caches[0].float(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(caches[3].float(), caches[1].float(), rtol=0, atol=0, equal_nan=True)
    assert caches[2].float().isnan().sum() == (nb * bs - 4) * hkv * d  # exactly the 4 real slots written


def test_software_e4m3_matches_torch_on_every_byte() -> None:
    """The byte path's decode of all 256 patterns and encode of every finite value (and of midpoints,
    which must round to even) agree with torch's float8_e4m3fn."""
    import triton
    import triton.language as tl

    @triton.jit
    def roundtrip(bits_ptr, values_ptr, x_ptr, enc_ptr, n_x, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        byte = offs < 256
        tl.store(values_ptr + offs, fp8.e4m3_value(tl.load(bits_ptr + offs, mask=byte)), mask=byte)
        x = tl.load(x_ptr + offs, mask=offs < n_x)
        tl.store(enc_ptr + offs, fp8.e4m3_bits(fp8.round_to_e4m3(x)), mask=offs < n_x)

    every = torch.arange(256, dtype=torch.uint8)
    finite = every.view(torch.float8_e4m3fn).float()
    finite = finite[finite.isfinite()].unique()  # sorted
    mids = (finite[1:] + finite[:-1]) / 2
    x = torch.cat([finite, -finite, mids, -mids, torch.tensor([500.0, -1e6, 1e-9])])
    values = torch.full((256,), float("nan"))
    enc = torch.zeros(x.numel(), dtype=torch.uint8)
    roundtrip[(1,)](every, values, x, enc, x.numel(), BLOCK=1024)
    want_values = every.view(torch.float8_e4m3fn).float()
    torch.testing.assert_close(values, want_values, rtol=0, atol=0, equal_nan=True)
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    torch.testing.assert_close(enc.view(torch.float8_e4m3fn).float(), want, rtol=0, atol=0)
