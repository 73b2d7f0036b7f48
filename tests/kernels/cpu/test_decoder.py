"""The fused CPU decoder (kernels/cpu/decoder.c): the whole stack in one C call gives exactly the numbers of
the layer-by-layer forward at every instruction-set level (the ``isa`` fixture), and only the models and steps
it was made for take it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from lbd.engine.config.args import EngineArgs
from lbd.engine.core.device_batch import device_batch
from lbd.engine.core.host_batch import HostBatch
from lbd.engine.core.runner import ModelRunner
from lbd.kernels import cpu, ops
from lbd.kernels.cpu import PREFILL_IN_C_MAX_LEN, packed
from lbd.kernels.cpu import decoder as fused
from lbd.kernels.metadata import AttentionMetadata
from support.tiny import make_tiny_llama

pytestmark = pytest.mark.skipif(cpu.library() is None or ops.MODE != "auto",
                                reason="no C compiler for lbd.kernels.cpu, or LBD_KERNELS forces another")
# the engine packs (and so fuses) where packed_gemm.c has a vector kernel, AVX2 up; elsewhere by design not
needs_packed = pytest.mark.skipif(not packed.supported(torch.float32), reason="packing needs AVX2 here")


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    # wider than tiny_llama so the kernels' row and panel splits and the vector loops all take part
    path = make_tiny_llama(tmp_path_factory.mktemp("fused-llama"), layers=3, hidden=256, heads=8, kv_heads=2,
                           intermediate=512, max_pos=1024)
    args = EngineArgs(model=str(path), kv_cache_memory_bytes=16 << 20, max_model_len=1024)
    runner = ModelRunner.from_args(args, str(path))
    if not packed.supported(torch.float32):  # the scalar level: pack anyway, so decoder.c runs there too
        for module in runner.model.modules():
            if getattr(module, "packable_weight", False) and isinstance(module.weight, torch.nn.Parameter):
                weight = module.weight.detach().contiguous()
                del module._parameters["weight"]
                module.weight = packed.pack(weight)
    return runner


def _both_paths(runner: ModelRunner, host: HostBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(fused forward, layer-by-layer forward) of the same batch; each writes the same K/V first."""
    model = runner.model
    decoder = model.fused_decoder()
    assert decoder is not None
    batch = device_batch(host, runner.block_size, runner.torch_device)
    with torch.inference_mode():
        got = model(batch.input_ids, batch.positions, batch.meta, runner.kv_caches)
        model._fused = None
        try:
            want = model(batch.input_ids, batch.positions, batch.meta, runner.kv_caches)
        finally:
            model._fused = decoder
    return got, want


@pytest.mark.usefixtures("isa")  # weights packed at the default level: the layout is every level's
def test_decode_and_mixed_steps_match_the_layer_path_bit_for_bit(runner: ModelRunner) -> None:
    rng = random.Random(0)
    bs = runner.block_size
    blocks = list(range(1, runner.num_blocks))
    rng.shuffle(blocks)  # scattered blocks, as in a server that has run a while

    def table(tokens: int) -> list[int]:
        return [blocks.pop() for _ in range(-(-tokens // bs))]

    prefill = HostBatch([rng.randrange(50, 200) for _ in range(40)], [0], [40], [40], [table(40)], [39], 0)
    got, want = _both_paths(runner, prefill)  # a whole prompt: every token a decode over its prefix
    assert torch.equal(got, want)
    # 5 decodes at 40..44 tokens of context, then a fresh 7-token prompt and a 9-token chunk of a longer one
    lens = [40 + i for i in range(5)]
    tables = [table(n + 1) for n in lens] + [table(7), table(30)]
    width = max(len(t) for t in tables)
    tables = [t + [0] * (width - len(t)) for t in tables]
    mixed = HostBatch([rng.randrange(50, 200) for _ in range(5 + 7 + 9)], [*lens, 0, 21],
                      [1] * 5 + [7, 9], [n + 1 for n in lens] + [7, 30], tables, [0, 1, 2, 3, 4, 11, 20], 5)
    got, want = _both_paths(runner, mixed)
    assert torch.equal(got, want)
    decode = HostBatch(mixed.input_ids[:5], lens, [1] * 5, [n + 1 for n in lens], tables[:5], list(range(5)),
                       5)
    got, want = _both_paths(runner, decode)
    assert torch.equal(got, want)


def _meta(query_lens: list[int], seq_lens: list[int], num_decodes: int) -> AttentionMetadata:
    empty = torch.zeros(0, dtype=torch.int32)
    return AttentionMetadata(empty, empty, empty, empty.long(), max(query_lens), max(seq_lens), num_decodes,
                             num_decodes, query_lens, seq_lens)


def test_steps_outside_the_c_attention_take_the_layer_path() -> None:
    assert fused.usable(_meta([1, 1, 20], [90, 12, 20], 2), 22)
    assert fused.usable(_meta([1, PREFILL_IN_C_MAX_LEN], [4000, PREFILL_IN_C_MAX_LEN], 1), 513)
    assert not fused.usable(_meta([1, 100], [90, PREFILL_IN_C_MAX_LEN + 1], 1), 101)  # a long prefill
    assert not fused.usable(_meta([1, 20], [90, 20], 1), 24)  # padding rows
    assert not fused.usable(_meta([0], [0], 0), 0)  # nothing to run


@needs_packed
def test_only_plain_fp32_llama_stacks_are_fused(runner: ModelRunner, tiny_qwen3: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    assert runner.model.fused_decoder() is not None
    qwen3 = ModelRunner.from_args(EngineArgs(model=str(tiny_qwen3), kv_cache_memory_bytes=1 << 20),
                                  str(tiny_qwen3))
    assert qwen3.model.fused_decoder() is None  # per-head q/k norms: the layer path
    monkeypatch.setenv("LBD_FUSED_DECODER", "0")
    path = Path(runner.model_path)
    off = ModelRunner.from_args(EngineArgs(model=str(path), kv_cache_memory_bytes=1 << 20,
                                           max_model_len=1024), str(path))
    assert off.model.fused_decoder() is None
