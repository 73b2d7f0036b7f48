"""KV blocks as bytes (lbd.engine.kv_transfer.blocks): read and write round-trip over both cache layouts the
runner allocates (K/V pairs, MLA's one latent tensor), and the byte count per token is the layout's."""

from __future__ import annotations

import pytest
import torch

from lbd.engine.core.kv_alloc import allocate
from lbd.engine.kv_transfer.blocks import KVBlockIO
from lbd.engine.models.kv_spec import KVSpec


@pytest.mark.parametrize("spec", [
    KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32),
    KVSpec(num_layers=2, num_kv_heads=1, head_dim=40, block_size=4, dtype=torch.bfloat16, num_tensors=1),
    KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float8_e4m3fn),
], ids=["kv-fp32", "mla-bf16", "kv-fp8"])
def test_blocks_round_trip_and_bytes_match_the_layout(spec: KVSpec) -> None:
    src, dst = allocate(spec, 6, torch.device("cpu")), allocate(spec, 6, torch.device("cpu"))
    for layer in src:
        for t in layer if isinstance(layer, tuple) else (layer,):
            t.copy_(torch.randn(t.shape).to(t.dtype))
    a, b = KVBlockIO(src), KVBlockIO(dst)
    assert a.layout == b.layout and a.block_bytes == spec.bytes_per_block
    data = a.read([4, 1])
    assert len(data) == 2 * spec.bytes_per_token * spec.block_size
    b.write([0, 5], data)
    for ls, ld in zip(src, dst, strict=True):
        for ts, td in zip(ls if isinstance(ls, tuple) else (ls,), ld if isinstance(ld, tuple) else (ld,),
                          strict=True):
            assert torch.equal(ts[4].view(torch.uint8), td[0].view(torch.uint8))
            assert torch.equal(ts[1].view(torch.uint8), td[5].view(torch.uint8))
            assert not td[2].view(torch.uint8).any()  # untouched blocks stay as they were
    with pytest.raises(ValueError, match="expected"):
        b.write([0], data)


def test_layouts_of_different_caches_differ() -> None:
    one = KVBlockIO(allocate(KVSpec(2, 2, 8, 4, torch.float32), 2, torch.device("cpu")))
    other = KVBlockIO(allocate(KVSpec(2, 2, 8, 8, torch.float32), 2, torch.device("cpu")))
    assert one.layout != other.layout
