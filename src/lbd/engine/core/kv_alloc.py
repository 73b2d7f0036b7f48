"""Sizing and allocating the paged KV cache."""

from __future__ import annotations

import logging

import torch

from lbd.engine.models.kv_spec import KVSpec
from lbd.kernels.cpu import pages as cpu_pages

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 4 << 30
CPU_RAM_FRACTION = 0.5  # never take more than this share of the RAM that is free at start
ZERO_PAGES_BYTES = 64 << 20  # larger CPU buffers come from fresh mmap (zero pages) in glibc


def kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    raise ValueError(f"--kv-cache-dtype {name!r} is not supported: use auto or fp8")


def cpu_num_blocks(spec: KVSpec, requested_bytes: int | None) -> int:
    """Blocks that fit ``--kv-cache-memory-bytes`` (default 4 GiB), capped at half of the free RAM."""
    import psutil

    budget = requested_bytes or DEFAULT_CPU_KV_BYTES
    cap = int(psutil.virtual_memory().available * CPU_RAM_FRACTION)
    if budget > cap:
        logger.warning("KV-cache budget %.2f GiB exceeds half of the free RAM; using %.2f GiB",
                       budget / 2**30, cap / 2**30)
        budget = cap
    return budget // spec.bytes_per_block


def allocate(spec: KVSpec, num_blocks: int, device: torch.device) -> list:
    """One buffer for every layer's caches, [layers, tensors, blocks, block_size, Hkv, d]; per layer a
    (key, value) pair of views, or for a one-tensor spec one [blocks, block_size, Hkv * d] view.

    Attention multiplies zero weights with the unused slots of a sequence's last block, so those must hold
    finite numbers: the buffer starts zeroed. On CPU a large buffer is an anonymous mmap of its own (zero
    pages, advised for transparent huge pages: ``lbd.kernels.cpu.pages``): it costs RAM as blocks are used
    (a multi-GiB budget is then free until needed). Not ``torch.empty``: malloc serves a large request from
    freed heap memory when it has some (garbage, and in fp8 some bytes are NaN).
    """
    shape = (spec.num_layers, spec.num_tensors, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    nbytes = spec.bytes_per_block * num_blocks
    if device.type == "cpu" and nbytes >= ZERO_PAGES_BYTES:  # zero-filled, committed on first touch
        buf = cpu_pages.zeroed(nbytes).view(spec.dtype).view(shape)
    else:
        buf = torch.zeros(shape, dtype=spec.dtype, device=device)
    if spec.num_tensors == 1:
        return [buf[i, 0].view(num_blocks, spec.block_size, -1) for i in range(spec.num_layers)]
    return [(buf[i, 0], buf[i, 1]) for i in range(spec.num_layers)]
