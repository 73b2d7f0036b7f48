"""The engine's configuration in slices: every flag lands in exactly one slice under its own name, the
command line reaches the slices unchanged, and the device's defaults are applied in one place."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from lbd.engine.config.args import EngineArgs, engine_args_from_namespace, make_parser
from lbd.engine.config.slices import SLICES, EngineConfig, SchedulerLimits, engine_config


def test_every_flag_is_in_exactly_one_slice() -> None:
    flags = {f.name for f in dataclasses.fields(EngineArgs)} - {"extra"}
    owners: dict[str, list[str]] = {}
    for name, cls in SLICES.items():
        for f in dataclasses.fields(cls):
            owners.setdefault(f.name, []).append(name)
    assert {k: v for k, v in owners.items() if len(v) > 1} == {}
    assert set(owners) == flags, (sorted(flags - set(owners)), sorted(set(owners) - flags))
    assert [f.name for f in dataclasses.fields(EngineConfig)] == list(SLICES)


def test_defaults_of_the_slices_are_the_flags_defaults() -> None:
    args = EngineArgs()
    for cls in SLICES.values():
        if cls is SchedulerLimits:  # device defaults, below
            continue
        for f in dataclasses.fields(cls):
            if f.name not in ("device", "dtype"):
                assert f.default == getattr(args, f.name), (cls.__name__, f.name)


def test_the_command_line_reaches_the_slices() -> None:
    ns = make_parser().parse_args(["--max-num-seqs", "7", "--block-size", "32", "--tensor-parallel-size", "2",
                                   "--port", "9001", "--profile-steps", "5", "--dtype", "float16",
                                   "--max-num-batched-tokens", "100", "--max-prefill-tokens-with-decodes",
                                   "400"])
    cfg = engine_config(engine_args_from_namespace(ns), "cuda")
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (7, 100)
    assert cfg.scheduler.max_prefill_tokens_with_decodes == 100  # never above the step's budget
    assert (cfg.cache.block_size, cfg.parallel.tensor_parallel_size, cfg.server.port) == (32, 2, 9001)
    assert (cfg.observability.profile_steps, cfg.model.dtype, cfg.model.device) == (5, "float16", "cuda")


@pytest.mark.parametrize("device, seqs, tokens, mixed, dtype", [
    ("cuda", 256, 8192, None, "bfloat16"), ("cpu", 128, 2048, 128, "float32"),
    ("sim", 256, 8192, None, "float32"),
])
def test_device_defaults(device: str, seqs: int, tokens: int, mixed: int | None, dtype: str) -> None:
    cfg = engine_config(EngineArgs(), device)
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (seqs, tokens)
    assert (cfg.scheduler.max_prefill_tokens_with_decodes, cfg.model.dtype) == (mixed, dtype)


def test_an_unresolved_device_is_refused() -> None:
    with pytest.raises(ValueError, match="resolved device"):
        engine_config(EngineArgs(), "auto")


def test_slices_stay_torch_free() -> None:
    code = ("import sys, lbd.engine.config.slices\n"
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
