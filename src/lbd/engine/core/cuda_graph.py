"""CUDA graphs for decode-only steps: the model's forward captured once per padded batch size.

A decode step of a small model is dominated by kernel launches; replaying a captured graph launches them
all at once. Inputs live in static buffers that each replay overwrites; a batch is padded up to the next
captured size with rows that write nothing (slot -1) and attend to one key of block 0. The attention kernels
get ``max_seq_len = max_model_len`` and read the real lengths from ``seq_lens`` on the device, so one graph
serves every context length. Prefill and mixed steps run eagerly.

In a tensor/pipeline-parallel worker the same graphs are captured per worker: TP collectives inside the
forward are captured with it (NCCL), and a pipeline stage after the first (``carry_dim``) reads the previous
stage's (hidden, residual) from a static buffer too; a stage before the last returns its pair.
"""

from __future__ import annotations

import logging
import time

import torch

from lbd.engine.core.device_batch import StepBatch
from lbd.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, 257, 8))
    return [s for s in sizes if s <= max_num_seqs] or [1]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list, max_num_seqs: int, max_model_len: int,
                 block_size: int, device: torch.device, carry_dim: int | None = None) -> None:
        t0 = time.monotonic()
        self.model, self.kv_caches, self.max_model_len = model, kv_caches, max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        width = (max_model_len + block_size - 1) // block_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.carry = None if carry_dim is None else torch.zeros(
            2, n, carry_dim, dtype=next(model.parameters()).dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = {}
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first so smaller graphs reuse its memory pool
                meta = self._meta(size)
                for _ in range(2):  # warm up: Triton autotuning and lazy allocations happen outside capture
                    self._run_model(size, meta)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self._run_model(size, meta)
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.synchronize(device)
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s", len(self.sizes),
                    self.sizes[0], self.sizes[-1], time.monotonic() - t0)

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size], max_query_len=1,
            max_seq_len=self.max_model_len, num_decodes=size, num_decode_tokens=size)

    def _run_model(self, size: int, meta: AttentionMetadata):  # noqa: ANN202 (a tensor or a pair)
        if self.carry is None:
            return self.model(self.input_ids[:size], self.positions[:size], meta, self.kv_caches)
        carry = (self.carry[0, :size], self.carry[1, :size])
        return self.model(self.input_ids[:size], self.positions[:size], meta, self.kv_caches, carry)

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def run(self, batch: StepBatch, carry: tuple[torch.Tensor, torch.Tensor] | None = None):  # noqa: ANN201
        n = batch.meta.num_seqs
        if carry is not None and self.carry is not None:
            self.carry[0, :n].copy_(carry[0])
            self.carry[1, :n].copy_(carry[1])
        size = next(s for s in self.sizes if s >= n)
        meta = batch.meta
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if size > n:  # padding rows: write nothing, attend to one key
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size].zero_()
        self.graphs[size].replay()
        out = self.outputs[size]
        return (out[0][:n], out[1][:n]) if isinstance(out, tuple) else out[:n]
