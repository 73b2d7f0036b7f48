"""The C decode attention (lbd.kernels.cpu) against the dense fp64 oracle and the torch reference."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch

from lbd.kernels import cpu
from lbd.kernels.reference import attention as ref
from support.paged_cases import dense_attention, make_case

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="no C compiler to build lbd.kernels.cpu")


@functools.cache
def _case_and_oracle(lens: tuple[tuple[int, int], ...], heads: int, kv_heads: int, head_dim: int,
                     block_size: int, pad_tokens: int, dtype: torch.dtype = torch.float32):  # noqa: ANN202
    """A case and its fp64 oracle, made once for every level (the kernels only read them)."""
    case = make_case(list(lens), heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                     dtype=dtype, pad_tokens=pad_tokens)
    return case, dense_attention(case)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (8, 8, 128, 16), (4, 1, 80, 32), (6, 2, 32, 8)])
@pytest.mark.usefixtures("isa")
def test_mixed_batch_matches_dense(heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
    # decodes of very different lengths (1 token to several blocks), then two prefill chunks
    lens = ((1, 1), (1, 17), (1, 300), (1, 64), (1, 5), (7, 40), (12, 12))
    case, want = _case_and_oracle(lens, heads, kv_heads, head_dim, block_size, 3)
    out = cpu.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale)
    n = sum(q for q, _ in lens)
    torch.testing.assert_close(out[:n].double(), want, atol=2e-5, rtol=1e-5)
    assert out[n:].abs().max() == 0  # padding rows are zero


@pytest.mark.parametrize("lens", [
    [(1, 40), (30, 30), (9, 600), (7, 50)],  # short, long (SDPA), short: two runs of rows in C
    [(1, 9), (125, 125), (125, 125), (16, 512)],  # every prefill short: one run, in place
], ids=["short-long-short", "all-short"])
@pytest.mark.usefixtures("isa")
def test_prefill_chunks_in_c_and_in_sdpa_match_dense(lens: list[tuple[int, int]]) -> None:
    """Prefill chunks of up to PREFILL_IN_C_MAX_LEN tokens run as one decode per query token, longer ones
    through SDPA, in the same batch."""
    assert max(s for _, s in lens) in (600, 512) and cpu.PREFILL_IN_C_MAX_LEN == 512
    case, want = _case_and_oracle(tuple(lens), 9, 3, 64, 16, 2)
    out = cpu.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale)
    n = sum(q for q, _ in lens)
    torch.testing.assert_close(out[:n].double(), want, atol=2e-5, rtol=1e-5)
    assert out[n:].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("isa")
def test_write_kv_cache_matches_reference(dtype: torch.dtype) -> None:
    """Key/value views into a fused qkv row, padding slots (-1) skipped, 70 tokens (two pool chunks)."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(70, (9 + 6) * 64, generator=g).to(dtype)
    key, value = qkv[:, 9 * 64:12 * 64].view(70, 3, 64), qkv[:, 12 * 64:].view(70, 3, 64)
    slots = torch.randperm(20 * 16, generator=g)[:70]
    slots[[3, 69]] = -1
    caches = [torch.randn(20, 16, 3, 64, generator=g).to(dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    assert cpu.write_ok(key, value, caches[0])
    cpu.write_kv_cache(key, value, caches[0], caches[1], slots)
    ref.write_kv_cache(key, value, want[0], want[1], slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    assert not cpu.write_ok(key, value, caches[0].to(torch.float8_e4m3fn))  # fp8 scales: the reference's


@pytest.mark.usefixtures("isa")
def test_strided_query_and_padding_sequence() -> None:
    """A query that is a view into a fused qkv row (as in the model), and a seq_len-0 filler row."""
    case = make_case([(1, 33), (1, 70), (1, 2)], heads=9, kv_heads=3, head_dim=64, block_size=16)
    qkv = torch.randn(3, (9 + 6) * 64)
    qkv[:, : 9 * 64] = case.query.reshape(3, -1)
    query = qkv[:, : 9 * 64].view(3, 9, 64)
    lens = case.meta.seq_lens.clone()
    lens[2] = 0
    out = torch.full_like(case.query, float("nan"))
    cpu.paged_decode(query, case.key_cache, case.value_cache, case.meta.block_tables, lens, lens.tolist(),
                     case.scale, out)
    want = ref.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale)
    torch.testing.assert_close(out[:2], want[:2], atol=1e-5, rtol=1e-5)
    assert out[2].abs().max() == 0


@pytest.mark.usefixtures("isa")
def test_many_threads_match_one() -> None:
    case = make_case([(1, n) for n in (90, 400, 33, 250, 1, 128, 77, 512)], heads=9, kv_heads=3, head_dim=64,
                     block_size=16)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale)
        torch.set_num_threads(2)
        two = cpu.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


def test_shares_torchs_openmp_runtime() -> None:
    """One libgomp in the process: the kernel's threads are torch's threads."""
    maps = open("/proc/self/maps").read()
    assert len({line.split()[-1] for line in maps.splitlines() if "libgomp" in line}) == 1


def test_no_compiler_falls_back_to_the_reference(tmp_path) -> None:
    code = ("import lbd.kernels.cpu as c; from lbd.kernels import ops; import torch;"
            "print(c.library() is None)")
    env = {"PATH": "/nonexistent", "LBD_CACHE_DIR": str(tmp_path), "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
    assert "no C compiler" in out.stderr


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (4, 4, 80)])
@pytest.mark.usefixtures("isa")
def test_bf16_cache_matches_dense(heads: int, kv_heads: int, head_dim: int) -> None:
    """bf16 query and caches: fp32 math on the stored values, one rounding of the output to bf16."""
    lens = ((1, 1), (1, 45), (1, 300), (5, 20))
    case, want = _case_and_oracle(lens, heads, kv_heads, head_dim, 16, 2, torch.bfloat16)  # fp64 oracle
    assert cpu.supports(case.query, case.key_cache)
    out = cpu.paged_attention(case.query, case.key_cache, case.value_cache, case.meta, case.scale)
    assert out.dtype == torch.bfloat16
    n = sum(q for q, _ in lens)
    torch.testing.assert_close(out[:3].double(), want[:3], atol=1e-2, rtol=2 ** -7)  # the C decodes
    torch.testing.assert_close(out[:n].double(), want, atol=3e-2, rtol=3e-2)  # + the torch prefill in bf16
    assert out[n:].abs().max() == 0
