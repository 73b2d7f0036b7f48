"""--kv-transfer-config (lbd.engine.config.kv_transfer): vLLM's keys and defaults; bad values exit 2 naming
the key and the fix; ranks it cannot run on are refused at start."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lbd.engine.config.kv_transfer import parse_kv_transfer_config


def test_keys_and_defaults() -> None:
    cfg = parse_kv_transfer_config(json.dumps({
        "kv_connector": "LbdConnector", "kv_role": "kv_consumer", "kv_port": 14579, "kv_rank": 1,
        "kv_parallel_size": 2, "kv_connector_extra_config": {"pull_timeout_s": 2, "lease_s": 30}}))
    assert (cfg.consumes, cfg.produces, cfg.kv_ip, cfg.pull_timeout_s, cfg.lease_s) == (
        True, False, "127.0.0.1", 2.0, 30.0)
    assert (cfg.port_for(0), cfg.port_for(3)) == (14579, 14582)
    both = parse_kv_transfer_config('{"kv_connector": "LbdConnector", "kv_role": "kv_both"}')
    assert both.consumes and both.produces and both.port_for(2) == 0
    assert parse_kv_transfer_config('{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}').produces


@pytest.mark.parametrize("text, needle", [
    ("{", "not valid JSON"),
    ("[]", "JSON object"),
    ('{"kv_connector": "MooncakeConnector", "kv_role": "kv_both"}', "kv_connector"),
    ('{"kv_connector": "LbdConnector", "kv_role": "kv_sometimes"}', "kv_role"),
    ('{"kv_connector": "LbdConnector", "kv_role": "kv_both", "kv_port": 70000}', "kv_port"),
    ('{"kv_connector": "LbdConnector", "kv_role": "kv_both", "nope": 1}', "unknown key"),
    ('{"kv_connector": "LbdConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"lease_s": 0}}',
     "lease_s"),
])
def test_bad_configs_name_the_key(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_kv_transfer_config(text)


@pytest.mark.parametrize("extra, needle", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 1"),
    (["--no-enable-prefix-caching"], "--no-enable-prefix-caching"),
])
def test_ranks_it_cannot_run_on_exit_2(extra: list[str], needle: str) -> None:
    cfg = '{"kv_connector": "LbdConnector", "kv_role": "kv_both"}'
    out = subprocess.run([sys.executable, "-m", "lbd.engine", "--kv-transfer-config", cfg, *extra],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and needle in out.stderr, out.stderr


def test_kv_ip_beyond_loopback_needs_the_cluster_token() -> None:
    cfg = '{"kv_connector": "LbdConnector", "kv_role": "kv_producer", "kv_ip": "10.1.2.3"}'
    env = {k: v for k, v in __import__("os").environ.items() if k != "LBD_CLUSTER_TOKEN"}
    out = subprocess.run([sys.executable, "-m", "lbd.engine", "--kv-transfer-config", cfg],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "LBD_CLUSTER_TOKEN" in out.stderr, out.stderr
