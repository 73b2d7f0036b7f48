"""A worker's model runner: ModelRunner over this worker's shard, plus the pipeline hand-offs and sampling.

Only ``_forward`` and ``_logits`` differ from the single-device runner: a stage after the first receives the
previous stage's (hidden, residual) before running its layers, a stage before the last sends its own after,
and the last stage's TP ranks gather the sampled rows' logits to TP rank 0. That rank (the sampler) keeps what
sampling needs across steps: each request's parameters, prompt (when a repetition penalty needs it) and the
tokens it sampled for it, updated as it samples (nothing is re-sent per step), and its seeded generators.
"""

from __future__ import annotations

import time

import torch

from lbd.engine.config.slices import EngineConfig
from lbd.engine.core.device_batch import StepBatch, device_batch
from lbd.engine.core.host_batch import HostBatch
from lbd.engine.core.runner import ModelRunner, cpu_threads
from lbd.engine.core.sampler import SampleRow
from lbd.engine.distributed.context import ParallelContext
from lbd.engine.structured.mask import TokenMask
from lbd.wire.core_messages import TokenLogprobs
from lbd.wire.executor_messages import NewRequest


class StageRunner(ModelRunner):
    def __init__(self, model_path: str, config: EngineConfig, parallel: ParallelContext) -> None:
        super().__init__(model_path, config.model, config.cache, config.scheduler, parallel,
                         threads=cpu_threads(config.parallel), allocate=False)
        assert parallel.groups is not None
        self.groups = parallel.groups
        self.hidden_size = self.model.cfg.hidden_size
        self.rows: dict[str, SampleRow] = {}
        self.step_s = 0.0
        self.steps = 0
        self._window_t0 = time.perf_counter()

    def facts(self) -> dict[str, object]:
        """What the core needs to know about the rank (the same on every worker)."""
        return {"block_size": self.block_size, "max_model_len": self.max_model_len,
                "vocab_size": self.vocab_size, "eos_token_id": self.eos_token_id,
                "device": self.device, "dtype": self.dtype, "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens}

    # ---- the pipeline --------------------------------------------------------------------------------------
    def _forward(self, batch: StepBatch, kv_caches: list) -> torch.Tensor | None:
        ctx = self.parallel
        carry = None
        if not ctx.is_first_stage:
            buf = torch.empty(2, batch.input_ids.shape[0], self.hidden_size, dtype=self.torch_dtype,
                              device=self.torch_device)
            self.groups.pp_recv(buf)
            carry = (buf[0], buf[1])
        if self.graphs is not None and batch.is_decode_only and self.graphs.fits(batch.meta.num_seqs):
            out = self.graphs.run(batch, carry)
        else:
            out = self.model(batch.input_ids, batch.positions, batch.meta, kv_caches, carry)
        if ctx.is_last_stage:
            return out
        self.groups.pp_send(torch.stack(out))
        return None

    def _capture_graphs(self):  # noqa: ANN202 (a DecodeGraphs)
        from lbd.engine.core.cuda_graph import DecodeGraphs

        times = self.groups.times
        timed, times.enabled = times.enabled, False  # no host timers (or syncs) inside a capture
        try:
            return DecodeGraphs(self.model, self.kv_caches, self.max_num_seqs, self.max_model_len,
                                self.block_size, self.torch_device,
                                carry_dim=None if self.parallel.is_first_stage else self.hidden_size)
        finally:
            times.enabled = timed

    # ---- a step --------------------------------------------------------------------------------------------
    def step(self, host: HostBatch, rids: list[str], new: list[NewRequest], finished: list[str],
             mask: tuple[list[int], bytes] = ([], b"")
             ) -> tuple[list[int], list[TokenLogprobs | None]] | None:
        """Run this worker's part of a step; the sampler returns (token ids, logprobs), the others None.
        ``mask``: the structured-output rows and their token bitmask, built by the core (``Step.mask``)."""
        t0 = time.perf_counter()
        sampler = self.parallel.is_sampler
        if sampler:
            self._update_rows(new, finished)
        batch = device_batch(host, self.block_size, self.torch_device)
        result = None
        with torch.inference_mode():
            hidden = self._forward(batch, self.kv_caches)
            if hidden is not None and host.sample_rows:
                logits = self._logits(hidden, batch)
                if logits is not None:
                    rows = [self.rows[r] for r in rids]
                    grammar = TokenMask.from_wire(*mask, len(rows), self.vocab_size) if mask[0] else None
                    ids, logprobs = self.sampler(logits, rows, grammar)
                    for row, token in zip(rows, ids, strict=True):
                        row.output_ids.append(token)
                    result = ids, logprobs
        if sampler and result is None:
            result = [], []
        self.step_s += time.perf_counter() - t0
        self.steps += 1
        return result

    def _update_rows(self, new: list[NewRequest], finished: list[str]) -> None:
        if finished:
            self.sampler.drop(finished)
            for rid in finished:
                self.rows.pop(rid, None)
        for r in new:
            self.rows[r.request_id] = SampleRow(r.request_id, r.sampling, r.prompt_token_ids or [],
                                                list(r.output_token_ids))

    def profile(self, reset: bool) -> dict[str, float]:
        now = time.perf_counter()
        stats = {"pp_rank": self.parallel.pp_rank, "tp_rank": self.parallel.tp_rank,
                 "wall_s": now - self._window_t0, "step_s": self.step_s, "steps": self.steps,
                 **self.groups.times.snapshot()}
        if reset:
            self.step_s, self.steps, self._window_t0 = 0.0, 0, now
            self.groups.times.reset()
        return stats
