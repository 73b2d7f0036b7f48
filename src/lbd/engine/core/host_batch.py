"""A step's batch as plain lists: what the scheduler decided, in the form the device batch is built from.

Built once per step from the SchedulerOutput (Python per sequence, never per token beyond the token ids), then
either turned into device tensors in the same process (``device_batch``) or sent as is to every
tensor/pipeline-parallel worker (``engine/executor``), which builds the same device batch. No torch here: the
core process of a multi-worker rank never loads a model.
"""

from __future__ import annotations

from dataclasses import dataclass

from lbd.engine.core.sched_output import ScheduledSeq


@dataclass(slots=True)
class HostBatch:
    input_ids: list[int]  # [T], decodes first
    starts: list[int]  # per sequence: tokens already in the cache (its first new token's position)
    query_lens: list[int]  # per sequence: new tokens this step
    seq_lens: list[int]  # per sequence: start + query_len
    tables: list[list[int]]  # per sequence: block ids, padded with 0 to one width
    sample_rows: list[int]  # row in the flat batch of each sampling sequence's last token
    num_decodes: int  # leading sequences with one new token

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode_only(self) -> bool:
        return len(self.input_ids) == len(self.starts)

    @classmethod
    def from_seqs(cls, seqs: list[ScheduledSeq], block_size: int) -> HostBatch:
        bs = block_size
        input_ids: list[int] = []
        starts: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        num_decodes = 0
        counting_decodes = True
        for s in seqs:
            r = s.request
            start, n = r.num_computed_tokens, s.num_new_tokens
            end = start + n
            if n == 1:
                input_ids.append(r.all_token_ids[start])
                num_decodes += counting_decodes
            else:
                input_ids.extend(r.all_token_ids[start:end])
                counting_decodes = False
            if s.sample:
                sample_rows.append(len(input_ids) - 1)
            starts.append(start)
            query_lens.append(n)
            seq_lens.append(end)
            tables.append(r.block_ids[: (end + bs - 1) // bs])
        width = max(len(t) for t in tables)
        if any(len(t) < width for t in tables):
            tables = [t + [0] * (width - len(t)) for t in tables]
        return cls(input_ids, starts, query_lens, seq_lens, tables, sample_rows, num_decodes)

    def to_wire(self) -> list:
        return [self.input_ids, self.starts, self.query_lens, self.seq_lens, self.tables, self.sample_rows,
                self.num_decodes]

    @classmethod
    def from_wire(cls, fields: list) -> HostBatch:
        return cls(*fields)
