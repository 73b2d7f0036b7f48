"""kv_transfer_params and the block pull (lbd.wire.kv_transfer): vLLM's field names, tolerant reading,
bad types as ValueErrors naming the field."""

from __future__ import annotations

import pytest

from lbd.wire import kv_transfer as KT


def test_vllm_fields_round_trip_and_unknown_ones_are_skipped() -> None:
    sent = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1",
            "remote_block_ids": [3, 4], "remote_host": "127.0.0.1", "remote_port": 5000,
            "remote_request_id": "r", "tp_size": 1, "remote_num_tokens": 40}
    params = KT.params_from_obj(sent)
    assert params.block_ids() == [3, 4]
    back = KT.params_to_obj(params)
    assert back == {k: v for k, v in sent.items() if k != "remote_num_tokens"}
    assert KT.params_from_obj({"remote_block_ids": [[7, 8]]}).block_ids() == [7, 8]  # per-group lists


@pytest.mark.parametrize("bad", ["x", {"remote_port": "p"}, {"remote_block_ids": [-1]},
                                 {"do_remote_decode": "yes"}])
def test_bad_params_are_value_errors(bad: object) -> None:
    with pytest.raises(ValueError, match="kv_transfer_params"):
        KT.params_from_obj(bad)


def test_pull_and_header_round_trip() -> None:
    pull = KT.KVPull("e", "t", [1, 2])
    assert KT.decode_pull(KT.encode(pull)) == pull
    header = KT.KVBlocksHeader("t", True, layout="float32/4/2x2x8,2x2x8/512", block_bytes=512, num_blocks=2)
    assert KT.decode_header(KT.encode(header)) == header
    with pytest.raises(ValueError):
        KT.decode_pull(b"\xc1")
