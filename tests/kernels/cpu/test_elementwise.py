"""The C RMSNorm, rotary and SiLU-and-mul (lbd.kernels.cpu) against torch, and their dispatch."""

from __future__ import annotations

import pytest
import torch

from lbd.kernels import cpu, ops
from lbd.kernels.reference import elementwise as ref_elem
from lbd.kernels.reference import rotary as ref_rotary
from lbd.kernels.rope_cache import build_rope_cache

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="no C compiler to build lbd.kernels.cpu")


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 crosses the threshold where rows go parallel
@pytest.mark.usefixtures("isa")
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
@pytest.mark.usefixtures("isa")
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


@pytest.mark.parametrize("rows", [1, 5, 300])  # 300 x 3072 goes parallel
@pytest.mark.usefixtures("isa")
def test_silu_and_mul_matches_reference(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    fused = torch.randn(rows, 3072 + 64, generator=g) * 6
    fused[0, :4] = torch.tensor([100.0, -100.0, 0.0, -0.0])  # saturated and signed-zero gates
    x = fused[:, :3072]  # rows of a wider buffer
    torch.testing.assert_close(cpu.silu_and_mul(x), ref_elem.silu_and_mul(x), atol=1e-5, rtol=1e-5)
    odd = torch.randn(3, 2 * 17, generator=g)  # the scalar tail past the 16-float vectors
    torch.testing.assert_close(cpu.silu_and_mul(odd), ref_elem.silu_and_mul(odd), atol=1e-6, rtol=1e-5)
    if ops.MODE == "auto":
        torch.testing.assert_close(ops.silu_and_mul(x), ref_elem.silu_and_mul(x), atol=1e-5, rtol=1e-5)


def test_dispatch_takes_fp32_cpu_and_leaves_the_rest() -> None:
    x = torch.randn(4, 32)
    assert cpu.elementwise_ok(x)
    assert not cpu.elementwise_ok(x.double())
    assert not cpu.elementwise_ok(x.t())  # columns, not rows, are contiguous
    half = torch.randn(4, 32, dtype=torch.float16)  # other dtypes still go to the reference
    out = ops.rms_norm(half, torch.ones(32, dtype=torch.float16), 1e-5)
    assert out.dtype == torch.float16


def test_linear_of_a_plain_weight_is_torchs() -> None:
    x, weight, bias = torch.randn(3, 40), torch.randn(64, 40), torch.randn(64)
    assert torch.equal(ops.linear(x, weight, bias), torch.nn.functional.linear(x, weight, bias))


@pytest.mark.parametrize("vocab", [1, 7, 31, 32, 49152, 49157])  # scalar rows, the vector loop, its tail
@pytest.mark.usefixtures("isa")
def test_argmax_matches_torch_with_ties_and_nans(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(70, vocab + 3, generator=g)[:, :vocab]  # rows of a wider buffer
    logits[1] = 0.5  # every value tied: the first index
    if vocab > 20:
        logits[2, 3] = logits[2, 19] = 1e9  # a tie between two lanes of the vector loop
        logits[3, vocab - 1] = float("inf")  # the maximum in the tail
        logits[4, 17] = float("nan")  # a NaN wins, as in torch
        logits[5, vocab - 1] = float("nan")  # ... also in the tail
        logits[6] = float("-inf")
        logits[7, 5], logits[7, 6] = -0.0, 0.0  # equal values of either sign: the first one
        logits[7, :5] = -1.0
        logits[7, 7:] = -1.0
    assert torch.equal(cpu.argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(ops.argmax(logits), logits.argmax(dim=-1))
    assert cpu.argmax(logits[:0]).shape == (0,)


@pytest.mark.usefixtures("isa")
def test_no_rows_is_no_work() -> None:  # a DP rank's dummy pass runs the layers over zero tokens
    empty = torch.zeros(0, 576)
    assert cpu.rms_norm(empty, torch.ones(576), 1e-5).shape == (0, 576)
    assert cpu.silu_and_mul(torch.zeros(0, 64)).shape == (0, 32)
