"""Wire format between a rank's core and its workers: msgpack frames, no pickling, no torch.

Core -> every worker, one PUB broadcast each, ``[kind, body]``:
  ``config``   {"args": EngineArgs fields, "model_path", "tp", "pp", "partition", "store": [host, port],
               "timeout_s", "timed"} (once, first)
  ``kv``       the rank's block count, after every worker said what it can hold
  ``step``     [seq, HostBatch.to_wire(), sampling request ids (one per sample row), new requests
               [[id, SamplingParams fields, prompt ids or None, output ids]], finished ids]
  ``profile``  reset: bool (answered by every worker with its counters)
  ``shutdown``
Worker -> core, PUSH to one PULL, ``[kind, world rank, body]``:
  ``blocks``   [blocks it can hold, facts of the model and device]     ``ready``    pid
  ``out``      [seq, token ids, logprobs [[chosen, top ids, top logprobs] or None]] (the sampler only)
  ``profile``  {counters}                                             ``error``    one-line reason
"""

from __future__ import annotations

from typing import Any

import msgpack

from lbd.wire.core_messages import SamplingParams, TokenLogprobs

CONFIG, KV, STEP, PROFILE, SHUTDOWN = "config", "kv", "step", "profile", "shutdown"
BLOCKS, READY, OUT, ERROR = "blocks", "ready", "out", "error"

_PARAM_FIELDS = SamplingParams.__struct_fields__


def pack(*parts: Any) -> bytes:
    return msgpack.packb(list(parts), use_bin_type=True)


def unpack(data: bytes) -> list[Any]:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def params_to_wire(p: SamplingParams) -> list[Any]:
    return [getattr(p, name) for name in _PARAM_FIELDS]


def params_from_wire(values: list[Any]) -> SamplingParams:
    return SamplingParams(*values)


def logprobs_to_wire(lps: list[TokenLogprobs | None]) -> list[Any]:
    return [None if lp is None else [lp.token_logprob, lp.top_ids, lp.top_logprobs] for lp in lps]


def logprobs_from_wire(values: list[Any]) -> list[TokenLogprobs | None]:
    return [None if v is None else TokenLogprobs(*v) for v in values]
