"""lbd.kernels.cpu.build: one build per instruction-set level, side by side in a process; levels the CPU lacks
or LBD_CPU_ISA caps away refused with the reason; the engine runs the capped level's kernels (fresh
interpreters, since the cap is read once)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lbd.kernels.cpu import build

pytestmark = pytest.mark.skipif(build.library() is None, reason="no C compiler to build lbd.kernels.cpu")
AVX2_ONLY = frozenset({"sse2", "avx", "avx2", "fma"})
AVX512_BF16 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
BF16_NEEDS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16")  # /proc/cpuinfo's names


def _refused_above_avx2(flags: frozenset[str]) -> str:
    """What a process capped at LBD_CPU_ISA=avx2 answers when asked for avx512bf16 on a CPU with ``flags``:
    the instruction sets the CPU lacks where it lacks any (an AVX2-only machine), else the cap."""
    lacks = [f for f in BF16_NEEDS if f not in flags]
    if not lacks:
        return ("CPU kernel level avx512bf16 is above LBD_CPU_ISA=avx2: unset LBD_CPU_ISA or raise it to run "
                "it")
    runs = ["scalar"]
    if {"avx2", "fma"} <= flags:
        runs += ["avx2", "avx512"] if "avx512f" in flags else ["avx2"]
    return (f"CPU kernel level avx512bf16: this CPU lacks {', '.join(lacks)}; use one of {', '.join(runs)} "
            "(LBD_CPU_ISA), or leave LBD_CPU_ISA unset for the best it runs")


def test_both_refusals_are_what_the_code_says_for_each_cpu() -> None:
    """The two answers to "avx512bf16, capped at avx2", each shown for the CPU that gets it (``refusal`` is
    the code ``allowed`` raises from, with the feature list set): an AVX-512 BF16 machine is refused by the
    cap, an AVX2-only one by what it lacks, an AVX-512 one without BF16 by its missing BF16 parts."""
    cap_msg = "CPU kernel level avx512bf16 is above LBD_CPU_ISA=avx2: unset LBD_CPU_ISA or raise it to run it"
    lacks_msg = ("CPU kernel level avx512bf16: this CPU lacks avx512f, avx512bw, avx512vl, avx512_bf16; use "
                 "one of scalar, avx2 (LBD_CPU_ISA), or leave LBD_CPU_ISA unset for the best it runs")
    assert build.refusal("avx512bf16", "avx2", AVX512_BF16) == _refused_above_avx2(AVX512_BF16) == cap_msg
    assert build.refusal("avx512bf16", "avx2", AVX2_ONLY) == _refused_above_avx2(AVX2_ONLY) == lacks_msg
    partial = AVX2_ONLY | {"avx512f"}
    assert build.refusal("avx512bf16", "avx2", partial) == _refused_above_avx2(partial)
    assert "lacks avx512bw, avx512vl, avx512_bf16; use one of scalar, avx2, avx512 " in build.refusal(
        "avx512bf16", "avx2", partial)
    assert build.refusal("avx2", "avx2", AVX2_ONLY) is None
    assert build.refusal("avx2", "scalar", AVX2_ONLY) == (
        "CPU kernel level avx2 is above LBD_CPU_ISA=scalar: unset LBD_CPU_ISA or raise it to run it")


@pytest.mark.usefixtures("isa")
def test_each_level_is_its_own_build() -> None:
    lib = build.library()
    assert lib is not None and build.isa_of(lib) == build.selected()
    assert build.library(build.selected()) is lib
    others = [build.library(level) for level in build.available() if level != build.selected()]
    assert all(other is not None and other is not lib for other in others)
    bits = lib.lbd_packed_gemm_support()  # fp32 packs from AVX2 up, bf16 with AVX-512 BF16 only
    assert bits == (build.selected() != "scalar") | (build.selected() == "avx512bf16") << 1


_CHILD = textwrap.dedent("""
    import sys
    import torch
    from lbd.engine.config.args import EngineArgs
    from lbd.engine.core.runner import ModelRunner
    from lbd.kernels import cpu, ops
    from lbd.kernels.cpu import build, packed
    path = sys.argv[1]
    runner = ModelRunner.from_args(EngineArgs(model=path, kv_cache_memory_bytes=1 << 20), path)
    packs = sum(isinstance(m.weight, ops.PackedWeight) for m in runner.model.modules()
                if isinstance(getattr(m, "weight", None), ops.PackedWeight | torch.nn.Parameter))
    print(build.isa_of(cpu.library()), cpu.elementwise_ok(torch.ones(2, 2)), packs > 0,
          runner.model.fused_decoder() is not None, packed.supported(torch.bfloat16))
    try:
        build.library("avx512bf16" if build.cap() != "avx512bf16" else "sse9")
    except ValueError as e:
        print(e)
""")


def _child(cap: str, model: Path) -> list[str]:
    env = {**os.environ, "LBD_CPU_ISA": cap}
    r = subprocess.run([sys.executable, "-c", _CHILD, str(model)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.splitlines()


@pytest.mark.skipif("avx2" not in build.available(), reason="this CPU lacks avx2 or fma, or LBD_CPU_ISA caps")
def test_the_engine_runs_the_capped_level(tiny_llama: Path) -> None:
    """Capped at AVX2 the engine still packs its fp32 weights, fuses the stack and runs the C kernels, at that
    level (bf16 stays on torch's GEMM: no VDPBF16PS); a level above the cap is refused, with the reason this
    CPU gets. (At scalar nothing packs: test_cpu_packed's pass test at that level.)"""
    kernels, above = _child("avx2", tiny_llama)
    assert kernels == "avx2 True True True False"
    # the cap's answer on an AVX-512 BF16 machine, the missing instruction sets' on a smaller one
    assert above == _refused_above_avx2(build.cpu_flags())


def test_the_default_is_the_best_level_the_cpu_runs_or_the_cap() -> None:
    want = os.environ.get("LBD_CPU_ISA") or build.levels()[-1]
    lib = build.library()
    assert build.cap() == build.selected() == build.available()[-1] == want
    assert lib is not None and build.isa_of(lib) == want


def test_a_bad_cap_is_refused() -> None:
    env = {**os.environ, "LBD_CPU_ISA": "avx1024"}
    r = subprocess.run([sys.executable, "-c", "from lbd.kernels import cpu; cpu.library()"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "LBD_CPU_ISA must be one of scalar, avx2, avx512, avx512bf16" in r.stderr
