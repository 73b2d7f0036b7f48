"""The packed CPU GEMM (kernels/cpu/packed_gemm.c) against torch at every instruction-set level (the ``isa``
fixture), the packing pass, and the kernels' thread pool (kernels/cpu/pool.c), in a child process: a pool
lives as long as the process that starts it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from lbd.kernels import cpu, ops
from lbd.kernels.cpu import build, packed

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="no C compiler to build lbd.kernels.cpu")


@pytest.mark.usefixtures("isa")
@pytest.mark.parametrize("m", [1, 5, 12, 13, 64, 250])  # 13: a partial tile; 250: several row blocks (K=1536)
@pytest.mark.parametrize(("n", "k"), [(1, 7), (31, 64), (33, 576), (960, 576), (96, 1536)])
def test_fp32_matches_torch(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    wide = torch.randn(m, k + 24, generator=g)
    x = wide[:, 5:5 + k]  # rows of a wider buffer, as a fused projection's slice would be
    w, bias = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    pw = packed.pack(w)
    assert pw.shape == (n, k) and pw.dtype == torch.float32
    torch.testing.assert_close(packed.linear(x, pw, bias), nn.functional.linear(x, w, bias), atol=2e-4,
                               rtol=1e-5)
    torch.testing.assert_close(ops.linear(x, pw), nn.functional.linear(x, w), atol=2e-4, rtol=1e-5)


@pytest.mark.usefixtures("isa")  # AVX-512 BF16's VDPBF16PS, the portable loop below it
@pytest.mark.parametrize("m", [1, 12, 64, 200])
@pytest.mark.parametrize(("n", "k"), [(33, 7), (960, 576), (64, 1536)])  # k=7: an odd K's last pair
def test_bf16_sums_in_fp32(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w, bias = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    out = packed.linear(x, packed.pack(w), bias)
    assert out.dtype == torch.bfloat16
    exact = nn.functional.linear(x.double(), w.double(), bias.double())
    # fp32 sums of exact bf16 products: only the final rounding to bf16 (2^-8 relative) is lost
    torch.testing.assert_close(out.double(), exact, atol=1e-2 * exact.abs().max().item(), rtol=2 ** -7)


@pytest.mark.usefixtures("isa")
def test_unpack_gives_the_weight_back() -> None:
    w = torch.randn(45, 30)
    assert torch.equal(packed.unpack(packed.pack(w)), w)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.packs_tied_head = True  # as LlamaForCausalLM says when its head is its one-device embedding
        self.lm_head = nn.Embedding(50, 16)
        self.proj = _Lin(16, 24)
        self.lm_head_packed = None


class _Lin(nn.Linear):
    packable_weight = True


@pytest.mark.usefixtures("isa")
def test_pack_linear_weights_replaces_parameters_and_packs_a_tied_head() -> None:
    model = _Tied()
    x = torch.randn(3, 16)
    want = model.proj(x).detach()
    head = model.lm_head.weight.detach().clone()
    if not packed.supported(torch.float32):  # the scalar level: torch's GEMM is faster than the portable loop
        assert ops.pack_linear_weights(model) == 0 and isinstance(model.proj.weight, nn.Parameter)
        return
    assert ops.pack_linear_weights(model) == 2
    assert isinstance(model.proj.weight, ops.PackedWeight)
    assert "proj.weight" not in dict(model.named_parameters())  # replaced, not doubled
    torch.testing.assert_close(ops.linear(x, model.proj.weight, model.proj.bias), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ops.linear(x, model.lm_head_packed), x @ head.t(), atol=1e-5, rtol=1e-5)
    assert torch.equal(model.lm_head.weight, head)  # the embedding itself is still there for the lookup


@pytest.mark.skipif(not packed.supported(torch.float32), reason="packing needs AVX2 (LBD_CPU_ISA=scalar)")
def test_no_tied_copy_where_the_model_does_not_ask() -> None:
    """A pipeline stage without the head (or a TP-sharded head) says packs_tied_head = False: no copy, no
    lookup of a head it does not hold."""
    model = _Tied()
    model.packs_tied_head = False
    del model.lm_head
    assert ops.pack_linear_weights(model) == 1
    assert model.lm_head_packed is None


_POOL_CHILD = textwrap.dedent("""
    import os, sys, torch
    from lbd.kernels import cpu
    from lbd.kernels.cpu import build, packed
    torch.manual_seed(0)
    torch.set_num_threads(1)
    w, x = torch.randn(960, 576), torch.randn(64, 576)
    q, kc, vc = torch.randn(24, 9, 64), torch.randn(200, 16, 3, 64), torch.randn(200, 16, 3, 64)
    tables = torch.randperm(200)[:24 * 8].view(24, 8).int()
    lens = torch.randint(1, 128, (24,)).int()
    rows = torch.randn(400, 576)
    cpus = [int(c) for c in sys.argv[1].split(",")]
    def attn():
        out = torch.empty_like(q)
        cpu.paged_decode(q, kc, vc, tables, lens, lens.tolist(), 0.125, out)
        return out
    rounds = 200 // len(build.available())
    for level in build.available():  # each level's build has a pool of its own
        with build.using(level):
            pw = packed.pack(w)
            before = (packed.linear(x, pw), attn(), cpu.rms_norm(rows, torch.ones(576), 1e-5))
            assert cpu.start_pool(cpus) and cpu.pool_threads() == len(cpus)
            assert len(os.sched_getaffinity(0)) == len(set(os.sched_getaffinity(0)))  # caller stays unpinned
            for _ in range(rounds):  # many loops back to back: helpers join late, sleep, wake
                assert torch.equal(packed.linear(x, pw), before[0])
                assert torch.equal(attn(), before[1])
                assert torch.equal(cpu.rms_norm(rows, torch.ones(576), 1e-5), before[2])
        print(level, "ok")
""")


@pytest.mark.parametrize("cpus", ["first,second", "first,first,first"])  # 3 threads on one CPU: late helpers
def test_pool_results_equal_one_thread(cpus: str) -> None:
    """At every level this process may run (the pool itself is plain C: no instruction set needed)."""
    import os

    have = sorted(os.sched_getaffinity(0))
    spec = cpus.replace("first", str(have[0])).replace("second", str(have[-1]))
    r = subprocess.run([sys.executable, "-c", _POOL_CHILD, spec], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == [w for level in build.available() for w in (level, "ok")]
