"""vLLM's per-request histograms, recorded by the front end when a sequence (and a prompt's n sequences) end.

The phases follow vLLM's definitions, on the core's clock: queue = first scheduled - queued; prefill = first
token - first scheduled; decode = last token - first token; inference = last token - first scheduled (any
preemption inside a phase counts in it). A sequence ended by a stop string in the front end keeps the
preemption count of its first output (the core's last word on it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lbd.engine.metrics import FrontendMetrics
    from lbd.engine.server.sequence import Sequence


def record_finished(m: FrontendMetrics, seq: Sequence, e2e_s: float, max_tokens_param: int | None) -> None:
    generated = seq.num_tokens
    prompt = len(seq.prompt_ids)
    m.e2e_request_latency.observe(e2e_s)
    m.prompt_tokens.observe(prompt)
    m.generation_tokens.observe(generated)
    m.prefill_kv_computed.observe(prompt - seq.num_cached)
    if max_tokens_param is not None:
        m.params_max_tokens.observe(max_tokens_param)
    times = phases(seq)
    if times is None:  # the core never produced a token for it
        return
    queue, prefill, decode, inference = times
    m.queue_time.observe(queue)
    m.prefill_time.observe(prefill)
    m.decode_time.observe(decode)
    m.inference_time.observe(inference)
    m.num_preemptions.observe(seq.timings[2])
    m.time_per_output_token.observe(decode / (generated - 1) if generated > 1 else 0.0)


def phases(seq: Sequence) -> tuple[float, float, float, float] | None:
    """(queue, prefill, decode, inference) seconds of a sequence, or None before its first token."""
    if seq.timings is None:
        return None
    queued_at, scheduled_at, _ = seq.timings
    first, last = seq.first_core_ts, seq.last_core_ts
    return (max(0.0, scheduled_at - queued_at), max(0.0, first - scheduled_at), max(0.0, last - first),
            max(0.0, last - scheduled_at))


def record_prompt_done(m: FrontendMetrics, n: int, max_generated: int) -> None:
    """Once all n sequences of a prompt ended (vLLM records these once per parent request)."""
    m.params_n.observe(n)
    m.max_num_generation_tokens.observe(max_generated)
