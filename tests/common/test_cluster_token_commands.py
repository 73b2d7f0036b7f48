"""Every command that takes the cluster token refuses a weak one at start-up (lbd.common.cluster
.read_strong_token), as `lbd serve` does (tests/serve/test_cluster_auth.py): a real `lbd supervise` (the
token in the environment or in --cluster-token-file) and a real `lbd route` (the environment) exit 2 before
anything starts, naming where the token came from and how to make one, and never printing the token."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from lbd.common.cluster import (
    CLUSTER_TOKEN_ENV,
    MIN_TOKEN_BITS,
    read_strong_internal_key,
    read_strong_token,
    token_bits,
)
from lbd.common.internal_key import INTERNAL_KEY_ENV
from support import free_port_run

WEAK = "s3cret-cluster-token"
FIX = "secrets.token_urlsafe(32)"


def _run(*argv: str, token: str | None = None, key: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (CLUSTER_TOKEN_ENV, INTERNAL_KEY_ENV)}
    if token is not None:
        env[CLUSTER_TOKEN_ENV] = token
    if key is not None:
        env[INTERNAL_KEY_ENV] = key
    return subprocess.run([sys.executable, "-m", "lbd", *argv], env=env, capture_output=True, text=True,
                          timeout=60)


def _supervise_flags(*dp: str) -> list[str]:
    base = free_port_run(3)
    return ["supervise", "--device", "sim", *(dp or ("--data-parallel-size", "2")), "--port", str(base),
            "--data-parallel-supervisor-port", str(base + 2)]


def test_read_strong_token_names_its_source(tmp_path: Path) -> None:
    assert token_bits(WEAK) < MIN_TOKEN_BITS
    strong = secrets.token_urlsafe(32)
    assert read_strong_token(None, {CLUSTER_TOKEN_ENV: strong}) == strong
    assert read_strong_token(None, {}) is None
    with pytest.raises(ValueError, match=CLUSTER_TOKEN_ENV):
        read_strong_token(None, {CLUSTER_TOKEN_ENV: WEAK})
    weak_file = tmp_path / "token"
    weak_file.write_text(WEAK + "\n")
    with pytest.raises(ValueError, match=f"--cluster-token-file {weak_file}"):
        read_strong_token(str(weak_file), {})


def test_lbd_supervise_refuses_a_weak_token(tmp_path: Path) -> None:
    """Its ranks inherit the token and derive CURVE and KV-transfer keys from it."""
    proc = _run(*_supervise_flags(), token=WEAK)
    assert proc.returncode == 2, proc.stderr
    assert CLUSTER_TOKEN_ENV in proc.stderr and FIX in proc.stderr and WEAK not in proc.stderr
    weak_file = tmp_path / "token"
    weak_file.write_text(WEAK + "\n")
    # a group across machines, which takes a token file
    group = ("--data-parallel-size", "4", "--data-parallel-size-local", "2",
             "--data-parallel-start-rank", "2", "--data-parallel-address", "10.0.0.1")
    proc = _run(*_supervise_flags(*group), "--cluster-token-file", str(weak_file))
    assert proc.returncode == 2, proc.stderr
    assert f"--cluster-token-file {weak_file}" in proc.stderr and FIX in proc.stderr
    assert WEAK not in proc.stderr


def test_lbd_route_refuses_a_weak_token() -> None:
    """It keys the CURVE load streams it follows with the token (lbd.router.load_feed)."""
    port = free_port_run(1)
    argv = ["route", "--host", "127.0.0.1", "--port", str(port), "--upstreams", "http://127.0.0.1:9"]
    proc = _run(*argv, token=WEAK)
    assert proc.returncode == 2, proc.stderr
    assert CLUSTER_TOKEN_ENV in proc.stderr and FIX in proc.stderr and WEAK not in proc.stderr


def test_every_command_refuses_a_weak_internal_key() -> None:
    """$LBD_INTERNAL_KEY signs forwarded ids (its HMACs travel with requests): `lbd route` and `lbd supervise`
    refuse a weak one at start-up as `lbd serve` does, naming the variable, never printing the key."""
    strong = secrets.token_urlsafe(32)
    assert read_strong_internal_key({INTERNAL_KEY_ENV: strong}) == strong
    assert read_strong_internal_key({}) is None
    with pytest.raises(ValueError, match=INTERNAL_KEY_ENV):
        read_strong_internal_key({INTERNAL_KEY_ENV: WEAK})
    route = ["route", "--host", "127.0.0.1", "--port", str(free_port_run(1)), "--upstreams",
             "http://127.0.0.1:9"]
    for argv in (route, _supervise_flags()):
        proc = _run(*argv, key=WEAK)
        assert proc.returncode == 2, proc.stderr
        assert INTERNAL_KEY_ENV in proc.stderr and FIX in proc.stderr and WEAK not in proc.stderr
