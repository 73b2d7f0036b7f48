"""The C RMSNorm, rotary and few-row linear (kernels.cpu) against torch, and their dispatch."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu, ops
from kernels.reference import elementwise as ref_elem
from kernels.reference import rotary as ref_rotary
from kernels.rope_cache import build_rope_cache

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="no C compiler to build kernels.cpu")


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 crosses the threshold where rows go parallel
def test_rms_norm_matches_reference(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    fused = torch.randn(rows, 960, generator=g) * 3
    x = fused[:, :576]  # rows of a wider buffer, as a projection's output slice would be
    weight, residual = torch.randn(576, generator=g), torch.randn(rows, 576, generator=g)
    torch.testing.assert_close(cpu.rms_norm(x, weight, 1e-5), ref_elem.rms_norm(x, weight, 1e-5),
                               atol=1e-5, rtol=1e-5)
    out, new_residual = cpu.rms_norm(x, weight, 1e-6, residual)
    want, want_residual = ref_elem.rms_norm(x, weight, 1e-6, residual)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(new_residual, want_residual)


@pytest.mark.parametrize(("head_dim", "rot_dim"), [(64, 64), (128, 64)])  # full and partial rotary
def test_rotary_matches_reference(head_dim: int, rot_dim: int) -> None:
    table = build_rope_cache(rot_dim, 256, 10000.0, None, torch.float32, torch.device("cpu"))
    qkv = torch.randn(40, (8 + 2 * 2) * head_dim)
    positions = torch.randint(0, 256, (40,))
    v_before = qkv[:, 10 * head_dim :].clone()
    want_q, want_k = qkv[:, : 8 * head_dim].clone(), qkv[:, 8 * head_dim : 10 * head_dim].clone()
    ref_rotary.rotary_embedding(positions, want_q, want_k, table, head_dim)
    q, k = qkv[:, : 8 * head_dim], qkv[:, 8 * head_dim : 10 * head_dim]
    cpu.rotary_neox(positions, q, k, table, head_dim)  # in place, on views into the fused buffer
    torch.testing.assert_close(q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, want_k, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, 10 * head_dim :], v_before)  # v, beside k in the same rows, untouched


def test_dispatch_takes_fp32_cpu_and_leaves_the_rest() -> None:
    x = torch.randn(4, 32)
    assert cpu.elementwise_ok(x)
    assert not cpu.elementwise_ok(x.double())
    assert not cpu.elementwise_ok(x.t())  # columns, not rows, are contiguous
    half = torch.randn(4, 32, dtype=torch.float16)  # other dtypes still go to the reference
    out = ops.rms_norm(half, torch.ones(32, dtype=torch.float16), 1e-5)
    assert out.dtype == torch.float16


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 32])  # 13: a partial second group of 8
@pytest.mark.parametrize("n", [577, 960, 4096])  # an odd N has a last row of W on its own
def test_linear_few_rows_matches_blas(rows: int, n: int) -> None:
    g = torch.Generator().manual_seed(rows * n)
    wide = torch.randn(rows, 640, generator=g)
    x = wide[:, :576]  # rows of a wider buffer
    weight, bias = torch.randn(n, 576, generator=g), torch.randn(n, generator=g)
    out = cpu.linear_few_rows(x, weight)
    if out is None:
        pytest.skip("this CPU has no AVX-512: the BLAS serves every linear")
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ops.linear(x, weight, bias), torch.nn.functional.linear(x, weight, bias),
                               atol=1e-4, rtol=1e-5)


def test_linear_leaves_other_shapes_to_the_blas() -> None:
    weight = torch.randn(64, 40)  # K not a multiple of 16
    x = torch.randn(3, 40)
    assert cpu.linear_few_rows(x, weight) is None
    assert torch.equal(ops.linear(x, weight), torch.nn.functional.linear(x, weight))
    many, weight2 = torch.randn(cpu.MAX_SKINNY_ROWS + 1, 64), torch.randn(32, 64)
    assert torch.equal(ops.linear(many, weight2), torch.nn.functional.linear(many, weight2))
