"""Every Triton kernel compiles for real NVIDIA targets (sm_80, sm_90) down to a cubin, without a GPU.

The interpreter runs kernels as numpy code and accepts things the GPU compiler rejects (and cannot run bf16
dots at all); compiling each kernel with the dtypes and constexprs the wrappers use catches those errors on
a machine with no driver. The compiler needs the real ``@triton.jit`` functions, so this file runs itself in
a child process without TRITON_INTERPRET (the test session has it set).

    TRITON_INTERPRET=0 python tests/kernels/triton_ops/test_compile.py full 90 80  # compile all, timed
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

if __name__ == "__main__" or os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lbd.kernels.triton_ops import attention_kernels as ak
    from lbd.kernels.triton_ops import elementwise, kv_cache, moe, rotary

FLOATS = {"eps", "scale", "qk_scale", "k_scale", "v_scale"}
ARCHS = (90, 80)


def _compile(kernel: triton.JITFunction, target: GPUTarget, act: str, constexprs: dict,
             ptrs: dict[str, str] | None = None) -> None:
    """Signature from the argument names: ``*_ptr`` -> pointer to ``act`` unless overridden, known float
    scalars -> fp32, other scalars -> i32."""
    ptrs = ptrs or {}
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
        elif name.endswith("_ptr"):
            sig[name] = "*" + act
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Triton 3.9's FP-fusion default notice
        compiled = triton.compile(ASTSource(kernel, sig, constexprs), target=target)
    assert compiled.asm["cubin"]


def compile_elementwise(target: GPUTarget, act: str) -> None:
    _compile(elementwise._rms_norm_kernel, target, act, {"HAS_RES": True, "BLOCK": 4096})
    _compile(elementwise._silu_and_mul_kernel, target, act, {"BLOCK": 1024})
    _compile(rotary._rotary_kernel, target, act,
             {"HEAD_DIM": 128, "HALF": 32, "HALF_PAD": 32, "QH_PAD": 32, "KH_PAD": 8, "IS_NEOX": False},
             {"pos_ptr": "*i64", "cs_ptr": "*fp32"})
    for cache, mode in ((act, 0), _fp8(target)):
        _compile(kv_cache._write_kv_kernel, target, act, {"HEAD_DIM": 128, "BLOCK": 1024, "FP8": mode},
                 {"kc_ptr": "*" + cache, "vc_ptr": "*" + cache, "slot_ptr": "*i64"})


def _fp8(target: GPUTarget) -> tuple[str, int]:
    """How an fp8 cache reaches the kernels: native e4m3 from sm_89 on, raw bytes (software mode) before."""
    return ("fp8e4nv", 1) if target.arch >= 89 else ("u8", 2)


def _attention_ptrs(cache: str) -> dict[str, str]:
    return {"kc_ptr": "*" + cache, "vc_ptr": "*" + cache, "bt_ptr": "*i32", "seq_lens_ptr": "*i32",
            "qsl_ptr": "*i32", "part_ptr": "*fp32", "lse_ptr": "*fp32"}


def compile_attention(target: GPUTarget, act: str, cache: str, head_dim: int) -> None:
    cache, mode = _fp8(target) if cache == "fp8" else (cache, 0)
    d_pad = triton.next_power_of_2(head_dim)
    prec = "ieee" if act == "fp32" else "tf32"
    common = {"HEAD_DIM": head_dim, "D_PAD": d_pad, "BLOCK_SIZE": 16, "FP8": mode,
              "DOT_PREC": prec}
    bm, bn = (64, 64) if d_pad <= 64 else (64, 32)
    ptrs = _attention_ptrs(cache)
    _compile(ak.prefill_kernel, target, act, {**common, "GROUP": 4, "BLOCK_M": bm, "BLOCK_N": bn}, ptrs)
    for splits in (1, 8):
        _compile(ak.decode_kernel, target, act,
                 {**common, "GROUP": 4, "G_PAD": 16, "BLOCK_N": 64, "NUM_SPLITS": splits}, ptrs)
    _compile(ak.reduce_splits_kernel, target, act,
             {"HEAD_DIM": head_dim, "D_PAD": d_pad, "NUM_SPLITS": 8, "S_PAD": 8}, ptrs)
    _compile(ak.zero_tail_kernel, target, act, {"BLOCK": 1024}, ptrs)


def compile_moe(target: GPUTarget, act: str) -> None:
    prec = "ieee" if act == "fp32" else "tf32"
    ints = {"pairs_ptr": "*i32", "block_expert_ptr": "*i32", "ids_ptr": "*i32", "w_ptr": "*fp32",
            "weights_ptr": "*fp32"}
    _compile(moe._topk_softmax_kernel, target, "fp32", {"TOP_K": 6, "K_PAD": 8, "E_PAD": 64, "RENORM": True},
             ints)
    gemm = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "DOT_PREC": prec}
    _compile(moe._gate_up_kernel, target, act, {**gemm, "TOP_K": 6}, {**ints, "w_ptr": "*" + act})
    _compile(moe._down_kernel, target, act, gemm, {**ints, "w_ptr": "*" + act, "out_ptr": "*fp32"})


QUICK = {"elementwise": ["bf16"], "attention": [("bf16", "fp8", 128)], "moe": ["bf16"]}
FULL = {"elementwise": ["bf16", "fp16", "fp32"],
        "attention": [("bf16", "bf16", 128), ("fp16", "fp8", 80), ("fp32", "fp32", 96),
                      ("bf16", "bf16", 64)],
        "moe": ["bf16", "fp32"]}


def compile_all(arch: int, plan: dict) -> None:
    target = GPUTarget("cuda", arch, 32)
    jobs = [(f"elementwise {a}", compile_elementwise, (a,)) for a in plan["elementwise"]]
    jobs += [(f"attention {a}/{c}/d{d}", compile_attention, (a, c, d)) for a, c, d in plan["attention"]]
    jobs += [(f"moe {a}", compile_moe, (a,)) for a in plan["moe"]]
    for name, fn, args in jobs:
        t = time.perf_counter()
        fn(target, *args)
        print(f"sm{arch} {name}: {time.perf_counter() - t:.1f}s", flush=True)


def _run_child(*argv: str) -> None:
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    run = subprocess.run([sys.executable, __file__, *argv], cwd=root, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, f"{argv}:\n{run.stdout}\n{run.stderr[-4000:]}"


def test_kernels_compile_for_sm90() -> None:
    """One bf16 configuration of every kernel (fp8 KV cache for attention)."""
    _run_child("quick", "90")


@pytest.mark.slow
def test_all_configurations_compile_for_sm90_and_sm80() -> None:
    _run_child("full", "90", "80")


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "full"
    for a in [int(x) for x in sys.argv[2:]] or ARCHS:
        compile_all(a, QUICK if which == "quick" else FULL)
