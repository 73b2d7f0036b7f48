"""A step's batch on the device: the flat tensors a forward takes, built from the host lists (``HostBatch``).

Shared by the single-device runner, the decode CUDA graphs (which copy a batch into their static buffers) and
a tensor/pipeline-parallel worker's stage runner, so none of them imports another for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lbd.engine.core.host_batch import HostBatch
from lbd.kernels.metadata import AttentionMetadata


@dataclass(slots=True)
class StepBatch:
    """One step's flat batch on the device plus what sampling needs."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: list[int]  # row in the flat batch of each sampling sequence's last token
    is_decode_only: bool



def device_batch(host: HostBatch, block_size: int, dev: torch.device) -> StepBatch:
    """The device tensors of a step from its host lists: per-token index tensors (positions, slots) come from
    a few vectorised ops on the device, never from Python loops over tokens."""
    bs = block_size
    num_seqs, num_tokens = len(host.starts), host.num_tokens
    block_tables = torch.tensor(host.tables, dtype=torch.int32, device=dev)
    ids_t = torch.tensor(host.input_ids, dtype=torch.int64, device=dev)
    per_seq = torch.tensor([host.starts, host.query_lens, host.seq_lens], dtype=torch.int32, device=dev)
    start_t, qlen_t, seqlen_t = per_seq[0], per_seq[1], per_seq[2]
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32, device=dev)
    torch.cumsum(qlen_t, 0, out=qsl[1:])
    if num_tokens == num_seqs:  # decode-only: one token per sequence
        seq_idx = torch.arange(num_tokens, device=dev)
        positions = start_t.long()
    else:
        seq_idx = torch.repeat_interleave(torch.arange(num_seqs, device=dev), qlen_t, output_size=num_tokens)
        positions = (torch.arange(num_tokens, device=dev) - qsl[seq_idx] + start_t[seq_idx]).long()
    slots = block_tables[seq_idx, positions // bs].long() * bs + positions % bs
    meta = AttentionMetadata(
        query_start_loc=qsl, seq_lens=seqlen_t, block_tables=block_tables, slot_mapping=slots,
        max_query_len=max(host.query_lens), max_seq_len=max(host.seq_lens), num_decodes=host.num_decodes,
        num_decode_tokens=host.num_decodes, query_lens_cpu=host.query_lens, seq_lens_cpu=host.seq_lens)
    return StepBatch(ids_t, positions, meta, host.sample_rows, num_tokens == num_seqs)
