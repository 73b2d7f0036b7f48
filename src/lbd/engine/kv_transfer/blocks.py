"""KV blocks as bytes: read from and written into the runner's paged cache (``ModelRunner.kv_caches``).

The runner's cache is, per layer, a (key, value) pair of [blocks, block_size, heads, dim] tensors, or one
tensor (MLA's latents). A transfer's bytes are tensor-major: for every cache tensor in order, the asked
blocks in the order asked. ``layout`` names dtype and per-block shapes, so two ranks whose caches differ
(model, dtype, block size) never exchange bytes: the consumer then recomputes instead.
"""

from __future__ import annotations

import warnings

import torch


class KVBlockIO:
    """Reads and writes whole blocks of one runner's KV cache."""

    def __init__(self, kv_caches: list) -> None:
        self.tensors: list[torch.Tensor] = [t for layer in kv_caches
                                            for t in (layer if isinstance(layer, tuple) else (layer,))]
        # bytes views (copies by index are not implemented for every dtype, fp8 among them)
        self._bytes = [t.view(torch.uint8) for t in self.tensors]
        if not self.tensors:
            raise ValueError("the runner holds no KV cache to transfer")
        first = self.tensors[0]
        self.per_tensor = [t[0].numel() * t.element_size() for t in self.tensors]
        self.block_bytes = sum(self.per_tensor)
        shapes = ",".join("x".join(str(d) for d in t.shape[1:]) for t in self.tensors[:2])
        dtype = str(first.dtype).removeprefix("torch.")
        self.layout = f"{dtype}/{len(self.tensors)}/{shapes}/{self.block_bytes}"
        self.wire_block_bytes = self.block_bytes  # every byte crosses the wire (a sim rank's: none)

    def read(self, block_ids: list[int]) -> memoryview:
        """The blocks' bytes (tensor-major), copied once out of the cache into one buffer."""
        n = len(block_ids)
        out = torch.empty(n * self.block_bytes, dtype=torch.uint8)
        if not n:
            return memoryview(out.numpy())
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.tensors[0].device)
        off = 0
        for t, size in zip(self._bytes, self.per_tensor, strict=True):
            part = out[off:off + n * size].view(n, *t.shape[1:])
            if t.device.type == "cpu":
                torch.index_select(t, 0, idx, out=part)
            else:
                part.copy_(t.index_select(0, idx))
            off += n * size
        return memoryview(out.numpy())

    def write(self, block_ids: list[int], data: bytes | memoryview) -> None:
        """Copy ``data`` (``read``'s format, same block count) into ``block_ids``."""
        n = len(block_ids)
        if len(data) != n * self.block_bytes:
            raise ValueError(f"expected {n * self.block_bytes} bytes for {n} blocks, got {len(data)}")
        if not n:
            return
        device = self.tensors[0].device
        with warnings.catch_warnings():  # read-only bytes: only read from here
            warnings.simplefilter("ignore", UserWarning)
            buf = torch.frombuffer(data, dtype=torch.uint8).to(device)
        idx = torch.tensor(block_ids, dtype=torch.long, device=device)
        off = 0
        for t, size in zip(self._bytes, self.per_tensor, strict=True):
            t.index_copy_(0, idx, buf[off:off + n * size].view(n, *t.shape[1:]))
            off += n * size
