"""The front end <-> core messages: every kind round-trips through ``encode``/``decode`` as its own type,
readers ignore fields they do not know and default the ones they miss (a core and a front end of neighbouring
versions still talk), a payload of the wrong shape is a ValueError, and the module stands alone (no torch,
nothing else of lbd)."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from lbd.wire import core_messages as CM
from lbd.wire.dp import DPState, DPStatus


def _samples() -> dict[bytes, msgspec.Struct]:
    lp = CM.TokenLogprobs(-0.25, [5, 9], [-0.25, -2.0])
    stats = CM.SchedulerStats(3, 1, 0.5, 100, 16, 40, 32, 500, 77)
    outputs = CM.EngineCoreOutputs(
        [CM.EngineCoreOutput("a", [5], [lp], None, None, 32, (1.0, 2.0, 0)),
         CM.EngineCoreOutput("b", [7, 8], None, "stop", 8)], stats, 1234.5)
    sampling = CM.SamplingParams(temperature=0.0, max_tokens=7, stop_token_ids=[4], seed=3, logprobs=2)
    return {
        CM.ADD: CM.EngineCoreRequest("r", [1, 2, 3], sampling, 2, 99.5),
        CM.ABORT: CM.Abort(["r", "s"], "stop"),
        CM.HELLO: CM.Hello(),
        CM.RESET: CM.ResetPrefixCache("x1"),
        CM.OUTPUTS: outputs,
        CM.READY: CM.CoreInfo("/m", 512, 16, 100, 1000, 2, 8, 256, "cpu", "float32", {"kv_events": None}),
        CM.ERROR: CM.RequestError("r", "Scheduler waiting queue is full", 503),
        CM.STATS: stats,
        CM.RESET_DONE: CM.ResetDone("x1", True),
        CM.DP: DPStatus(DPState.READY, 2, None, True, "alltoall", True, 3, 40, 5),
        CM.LORA: CM.LoraCommand("l1", "load", "sql", "/adapters/sql"),
        CM.LORA_DONE: CM.LoraDone("l1", 400, "DoRA adapters (use_dora) are not supported"),
    }


def test_every_kind_has_a_sample_and_a_type_of_its_own() -> None:
    samples = _samples()
    assert set(samples) == set(CM.MESSAGES)
    assert len(set(CM.MESSAGES.values())) == len(CM.MESSAGES)
    assert all(type(msg) is CM.MESSAGES[kind] for kind, msg in samples.items())


def _as_read(msg: msgspec.Struct) -> msgspec.Struct:
    """What a reader gets: each output carries its message's send time once decoded."""
    if not isinstance(msg, CM.EngineCoreOutputs):
        return msg
    return msgspec.structs.replace(msg, outputs=[msgspec.structs.replace(o, timestamp=msg.timestamp)
                                                 for o in msg.outputs])


@pytest.mark.parametrize("kind", sorted(CM.MESSAGES))
def test_round_trip(kind: bytes) -> None:
    msg = _samples()[kind]
    assert CM.decode(kind, CM.encode(msg)) == _as_read(msg)


@pytest.mark.parametrize("kind", sorted(CM.MESSAGES))
def test_unknown_fields_are_ignored(kind: bytes) -> None:
    msg = _samples()[kind]
    plain = msgspec.to_builtins(msg)
    if isinstance(plain, dict):
        plain["field_of_a_newer_version"] = {"nested": [1, 2]}
    else:  # positional: new fields come at the end
        plain.append("field of a newer version")
    assert CM.decode(kind, msgspec.msgpack.encode(plain)) == _as_read(msg)


def test_nested_unknown_fields_and_missing_defaults() -> None:
    """An output row of a newer core (one more column) and a request of an older front end (fewer sampling
    fields) both read."""
    row = ["a", [5], None, "length", None, 0, None, 0.0, None, "new column"]
    stats = msgspec.to_builtins(CM.SchedulerStats())
    back = CM.decode(CM.OUTPUTS, msgspec.msgpack.encode([[row], stats, 7.0]))
    assert back.outputs[0].new_token_ids == [5] and back.outputs[0].timestamp == 7.0
    old = {"request_id": "r", "prompt_token_ids": [1], "sampling": {"max_tokens": 3}, "eos_token_id": None,
           "arrival_time": 0.0}
    req = CM.decode(CM.ADD, msgspec.msgpack.encode(old))
    assert req.sampling == CM.SamplingParams(max_tokens=3)
    stats = CM.decode(CM.STATS, msgspec.msgpack.encode([1, 2]))
    assert (stats.num_running, stats.num_waiting, stats.block_size) == (1, 2, 16)


@pytest.mark.parametrize("kind, payload", [
    (CM.ADD, b"\xc1garbage"),
    (CM.ADD, msgspec.msgpack.encode({"request_id": "x"})),  # required fields missing
    (CM.ABORT, msgspec.msgpack.encode({"ids": ["a"], "reason": "because"})),  # not a reason
    (CM.ABORT, msgspec.msgpack.encode(["a"])),
    (b"bogus", b""),
])
def test_bad_payloads_are_value_errors(kind: bytes, payload: bytes) -> None:
    with pytest.raises(ValueError):
        CM.decode(kind, payload)


def test_the_module_stands_alone() -> None:
    code = ("import sys, lbd.wire.core_messages\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'zmq', 'lbd')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(['lbd', 'lbd.wire', 'lbd.wire.codec', 'lbd.wire.core_messages',
                                      'lbd.wire.dp', 'lbd.wire.kv_transfer', 'lbd.wire.tolerant'])
