"""The KV cache starts all zeros even when malloc has dirty freed memory to hand out (a large CPU buffer used
to be ``torch.empty``, and in fp8 some garbage bytes are NaN, which attention's zero weights on unused slots
turn into NaN outputs)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import ctypes
import torch
from lbd.engine.core import kv_alloc
from lbd.engine.models.kv_spec import KVSpec
libc = ctypes.CDLL(None)
libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: freed memory stays in the heap (the core keeps it too)
libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: large requests come from the heap as well
junk = [torch.full((16 << 20,), 0x7F, dtype=torch.uint8) for _ in range(12)]  # 0x7f: NaN in float8_e4m3fn
del junk
spec = KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.float8_e4m3fn)
blocks = (kv_alloc.ZERO_PAGES_BYTES * 2) // spec.bytes_per_block
caches = kv_alloc.allocate(spec, blocks, torch.device("cpu"))
k, v = caches[0]
print(int(k.view(torch.uint8).count_nonzero()) + int(v.view(torch.uint8).count_nonzero()))
"""


def test_large_cpu_kv_cache_is_zero_even_after_dirty_frees() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "0"
