"""Batched LoRA compute: the grouped CPU path, torch's gather path and the Triton kernel (under
TRITON_INTERPRET=1 here) give the same deltas for a batch mixing three adapters and the base model."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from lbd.engine.lora import compute
from lbd.engine.lora.slots import make_step


def _case(tokens_per_seq: list[int], slots: list[int], fan_in: int = 48, fan_out: int = 40, width: int = 16):
    gen = torch.Generator().manual_seed(0)
    num = sum(tokens_per_seq)
    x = torch.randn(num, fan_in, generator=gen)
    a = torch.randn(3, fan_in, width, generator=gen)
    b = torch.randn(3, width, fan_out, generator=gen)
    step = make_step(list(zip(slots, tokens_per_seq, strict=True)), torch.device("cpu"))
    return x, a, b, step


def _reference(y, x, a, b, token_slots):
    out = y.clone()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            out[t] += x[t] @ a[s] @ b[s]
    return out


def test_grouped_and_gathered_paths_match_the_per_token_reference() -> None:
    # decodes of adapters 0, 2, base, 0 (slot 0 twice: not contiguous -> gathered), then prefills
    x, a, b, step = _case([1, 1, 1, 1, 5, 3], [0, 2, -1, 0, 1, -1])
    y = torch.randn(x.shape[0], b.shape[2])
    want = _reference(y, x, a, b, step.token_slots)
    got = compute.add_grouped(y.clone(), x, a, b, step.groups)
    assert torch.allclose(got, want, atol=1e-4)
    assert torch.allclose(compute.add_gathered(y.clone(), x, a, b, step.token_slots), want, atol=1e-4)
    assert not torch.allclose(got, y)  # the deltas are there


def test_no_adapted_token_means_no_step() -> None:
    assert make_step([(-1, 4), (-1, 1)], torch.device("cpu")) is None


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernel runs on CPU tensors "
                    "only under TRITON_INTERPRET=1")
def test_triton_kernel_matches_under_the_interpreter() -> None:
    from lbd.engine.lora import triton_kernel

    x, a, b, step = _case([1, 1, 1, 3], [0, 2, -1, 1], fan_in=80, fan_out=70)
    y = torch.randn(x.shape[0], b.shape[2])
    want = _reference(y, x, a, b, step.token_slots)
    got = triton_kernel.add_lora(y.clone(), x, a, b, step.token_slots, block_k=32, block_n=32)
    assert torch.allclose(got, want, atol=1e-4)


def test_grouped_path_is_not_slower_than_the_gather_path() -> None:
    """The CPU path's choice, measured (run with -s for the numbers): 32 decodes of 3 adapters + base."""
    fan_in, fan_out, width = 576, 3072, 32
    gen = torch.Generator().manual_seed(1)
    slots = [i % 4 - 1 for i in range(32)]
    step = make_step([(s, 1) for s in slots], torch.device("cpu"))
    x, y = torch.randn(32, fan_in, generator=gen), torch.zeros(32, fan_out)
    a, b = torch.randn(3, fan_in, width, generator=gen), torch.randn(3, width, fan_out, generator=gen)

    def grouped() -> None:
        compute.add_grouped(y, x, a, b, step.groups)

    def gathered() -> None:
        compute.add_gathered(y, x, a, b, step.token_slots)

    times: dict = {grouped: [], gathered: []}
    for _ in range(7):  # interleaved, the best of each: a busy host slows both alike
        for fn in (grouped, gathered):
            t0 = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - t0)
    grouped, gathered = min(times[grouped]), min(times[gathered])
    print(f"\nLoRA gate_up delta, 32 decode tokens, 3 adapters + base: grouped {grouped * 1e6:.0f} us, "
          f"gathered {gathered * 1e6:.0f} us")
    assert grouped < gathered


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_triton_kernel_inside_the_engine(tmp_path) -> None:
    """The engine with every LoRA delta from the Triton kernel (interpreted, in a subprocess so the switch
    stays there) gives the grouped path's greedy tokens (this process) for two adapters and the base in one
    batch. One layer and two tokens (a prefill and a decode step) keep the interpreted launches few."""
    import ast
    import subprocess
    import sys

    from support.lora import make_adapter
    from support.tiny import make_tiny_llama

    model = make_tiny_llama(tmp_path / "one-layer", layers=1)
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parents[2])!r})
from lbd.engine.core.engine_core import EngineCore
from lbd.wire.core_messages import EngineCoreRequest
from support.parity import engine_args, greedy
core = EngineCore.from_args(engine_args({str(model)!r}, enable_lora=True, max_loras=2,
    lora_modules=["a={make_adapter(tmp_path / 'a', model, seed=1)}",
                  "b={make_adapter(tmp_path / 'b', model, seed=2, targets=('o_proj', 'up_proj'))}"]),
    {str(model)!r})
for rid, lora in (("a", "a"), ("b", "b"), ("base", None)):
    core.add_request(EngineCoreRequest(rid, [5, 6, 7, 8, 9], greedy(2), None, 0.0, lora_name=lora))
toks = {{}}
while core.has_work():
    for o in core.step():
        toks.setdefault(o.request_id, []).extend(o.new_token_ids)
print("triton kernel loaded:", "lbd.engine.lora.triton_kernel" in sys.modules)
print(sorted(toks.items()))
"""
    env = {**os.environ, "LBD_LORA_TRITON": "1", "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-2] == "triton kernel loaded: True"
    assert not compute._TRITON_ON_CPU  # this process: the grouped CPU path
    here: dict = {}
    exec(script, here)
    assert proc.stdout.strip().splitlines()[-1] == str(sorted(here["toks"].items()))
    toks = dict(ast.literal_eval(proc.stdout.strip().splitlines()[-1]))
    assert all(len(t) == 2 for t in toks.values())
    assert toks["a"] != toks["base"] and toks["b"] != toks["base"]  # the adapters did change the output
