"""Batch layout that attention kernels read: a flat, packed ("varlen") batch of queries over a paged cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """One step's batch. B sequences, T = query_start_loc[-1] new tokens packed in order.

    Sequence i owns queries ``query_start_loc[i]:query_start_loc[i+1]``; those queries are the last
    ``query_len_i`` tokens of its ``seq_lens[i]`` tokens (its first ``seq_lens[i] - query_len_i`` tokens are
    already in the cache, e.g. a cached prefix or earlier prefill chunks). Query j of sequence i sits at
    absolute position ``seq_lens[i] - query_len_i + j`` and attends causally to keys ``0..that position``.
    The keys live in the paged cache: token p of sequence i is in block ``block_tables[i, p // block_size]``
    at offset ``p % block_size``. New K/V are written first, by ``slot_mapping`` (T entries; slot =
    block_id * block_size + offset; -1 = padding, skipped), so attention reads every key from the cache.
    Sequences are ordered decodes first (query_len 1) then prefills; ``num_decodes`` counts the former so
    kernels can take a fast path for them.
    """

    query_start_loc: torch.Tensor  # int32 [B + 1], on device
    seq_lens: torch.Tensor  # int32 [B], on device
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], on device; unused entries arbitrary (e.g. 0)
    slot_mapping: torch.Tensor  # int64 [T], on device
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # the first num_decodes sequences have query_len 1
    num_decode_tokens: int  # == num_decodes (kept separate for clarity in kernels)
    # host copies (CPU lists) so the torch reference never syncs on device tensors
    query_lens_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])
