"""lbd.common, the rules every server shares: keys (constant time, any bytes), key files, redaction, TLS flag
checks, limits; and the router's token buckets built on them."""

from __future__ import annotations

from pathlib import Path

import pytest

from lbd.common.auth import KeyRing, bearer_token, engine_keys, read_key_file
from lbd.common.limits import Limits, check_limits
from lbd.common.redact import MASK, redact_argv, redact_text
from lbd.common.tls import check_tls
from lbd.router.auth import Bucket, Gate, requested_tokens, retry_after
from support import make_certs


def test_keys_from_flag_and_both_environment_variables() -> None:
    ring = engine_keys(["a"], {"VLLM_API_KEY": "b", "LBD_API_KEYS": "c\n\n d \n"})
    for key in ("a", "b", "c", "d"):
        assert ring.check_header(f"Bearer {key}") is not None
    assert ring.check_header("Bearer e") is None and ring.check_header("bearer a") is not None
    assert ring.check_header("Basic a") is None and ring.check_header(None) is None
    assert ring.check_header(b"Bearer \xff\xfe") is None  # not UTF-8: a wrong key, not an error
    assert ring.check_header("Bearer \udcff") is None  # aiohttp's surrogate-escaped bytes
    assert not engine_keys(None, {})
    assert bearer_token(b"  Bearer   tok  ") == b"tok" and bearer_token(b"Bearer ") is None


def test_key_file_lines_and_errors(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# team keys\nk1 name=alpha rps=2\nk2 tps=100  # trailing comment\n\nk3\n")
    keys = read_key_file(f)
    assert [(k.name, k.rps, k.tps) for k in keys][:2] == [("alpha", 2.0, None), (keys[1].name, None, 100.0)]
    assert keys[2].name.startswith("key-") and "k3" not in keys[2].name
    assert KeyRing(keys).check_header("Bearer k2") is keys[1]
    for bad in ("k1 rps=fast\n", "k1 colour=red\n", "k1 rps=0\n"):
        f.write_text(bad)
        with pytest.raises(ValueError, match="keys:1"):
            read_key_file(f)


def test_redaction() -> None:
    argv = ["python", "-m", "lbd.engine", "--api-key", "s3cret", "--admin-token=t0k",
            "--ssl-keyfile", "/k.pem",
            "--port", "8000"]
    assert redact_argv(argv) == ["python", "-m", "lbd.engine", "--api-key", MASK, f"--admin-token={MASK}",
                                 "--ssl-keyfile", "/k.pem", "--port", "8000"]
    line = "Authorization: Bearer abc.def --upstream-api-key=xyz VLLM_API_KEY=zzz LBD_INTERNAL_KEY=iii ok"
    out = redact_text(line)
    assert "abc.def" not in out and "xyz" not in out and "zzz" not in out and out.endswith("ok")
    assert "iii" not in out


def test_tls_and_limit_flags_are_checked_up_front(tmp_path: Path) -> None:
    ca, cert, key = make_certs(tmp_path)
    assert check_tls(str(cert), str(key), str(ca), 2) is None
    assert "needs --ssl-certfile" in check_tls(None, str(key), None, 0)
    assert "--ssl-ca-certs" in check_tls(str(cert), str(key), None, 2)
    assert "cannot load" in check_tls(str(tmp_path / "missing.pem"), None, None, 0)
    assert check_limits(Limits()) is None
    assert "--max-headers" in check_limits(Limits(max_headers=0))


def test_token_buckets() -> None:
    b = Bucket.full(rate=2.0, burst_s=1.0, now=0.0)  # 2 requests of room, 2 per second
    assert b.wait(0.0, 1) == 0.0
    b.take(1)
    b.take(1)
    assert b.wait(0.0, 1) == pytest.approx(0.5) and b.wait(0.5, 1) == 0.0
    t = Bucket.full(rate=10.0, burst_s=1.0, now=0.0)  # a request bigger than the bucket: admitted when full,
    assert t.wait(0.0, 50) == 0.0  # and leaves it in debt
    t.take(50)
    assert t.wait(0.0, 1) == pytest.approx(4.1) and retry_after(4.1) == 5
    gate = Gate(["k"], None, rps=1.0, tps=0.0, burst_s=1.0, workers=2)  # rate split among 2 workers
    key = gate.identify(b"Bearer k")
    assert key is not None and gate.limits_on and not gate.counts_tokens
    assert gate.admit(key, 0, now=0.0) == 0.0 and gate.admit(key, 0, now=0.0) == pytest.approx(2.0)
    assert requested_tokens(b'{"max_tokens": 7, "n": 3}') == 21
    assert requested_tokens(b'{"max_completion_tokens": 5}') == 5
    assert requested_tokens(b"not json") == requested_tokens(b'{"max_tokens": -1}') == 0
