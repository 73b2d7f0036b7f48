"""Acceptance: a rank whose model cannot load fails again and again. Its restarts back off to the cap, and
/status names the reason (the exception from its own stderr) within one backoff period, with the attempt
count and the last lines of its error; /readyz says why the node is not ready."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from support.node import SupervisorNode

INITIAL, CAP = 0.5, 1.0


@pytest.mark.slow
def test_model_that_cannot_load_backs_off_and_says_why(tiny_llama: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_llama, broken)
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    node = SupervisorNode(broken, 1, "--restart-backoff-initial-s", str(INITIAL), "--restart-backoff-max-s",
                          str(CAP), log=tmp_path / "node.log")
    try:
        node.wait_for(lambda: node.get("/health").status_code == 200, 60, "the health port")
        seen_delays: list[float] = []
        first_failure_at = None
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            rank = node.rank(0)
            if rank["state"] == "restarting":
                if first_failure_at is None:
                    first_failure_at = time.monotonic()
                    # named within one backoff period of the failure: it is there as soon as it restarts
                    assert rank["attempts"] == 1 and rank["last_failure"], rank
                    assert "exited with code 1" in rank["last_failure"]
                    assert "Error" in rank["last_failure"], rank["last_failure"]  # its exception
                    assert rank["stderr_tail"] and len(rank["stderr_tail"]) <= 20
                    ready = node.get("/readyz")
                    assert ready.status_code == 503
                    assert "rank 0 restarting (attempt 2 in" in ready.text
                    assert "exited with code 1" in ready.text
                if rank["backoff_s"] is not None and (not seen_delays or rank["backoff_s"] != seen_delays[-1]
                                                      or rank["attempts"] > len(seen_delays)):
                    seen_delays.append(rank["backoff_s"])
                assert rank["next_start_in_s"] is None or rank["next_start_in_s"] <= CAP + 0.05
            if rank["attempts"] >= 3:
                break
            time.sleep(0.05)
        assert first_failure_at is not None and node.rank(0)["attempts"] >= 3, node.rank(0)
        delays = sorted(set(seen_delays))
        assert delays[0] == INITIAL and max(delays) == CAP, seen_delays  # doubling, then held at the cap
        assert node.get("/health").status_code == 200  # the supervisor itself is fine
        assert node.status()["ranks"][0]["restarts"] >= 2
    finally:
        node.close()
