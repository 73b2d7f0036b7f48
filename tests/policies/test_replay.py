"""The profiles decide as the one-block policies did: a seeded random trace (``replay_trace``), recorded with
the old implementation into ``replay_decisions.json``, replayed through the pipeline case by case."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest


def _generator():  # (the suite imports test files by path: no package to import it from)
    spec = importlib.util.spec_from_file_location("replay_trace", Path(__file__).with_name("replay_trace.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("replay_trace", module)
    spec.loader.exec_module(module)
    return module


_gen = _generator()
CONFIGS, FIXTURE, run = _gen.CONFIGS, _gen.FIXTURE, _gen.run
RECORDED = json.loads(FIXTURE.read_text())


def test_the_fixture_covers_every_configuration() -> None:
    assert [(c["policy"], c["options"]) for c in RECORDED] == [(n, o) for n, o in CONFIGS]
    assert sum(len(c["outcomes"]) for c in RECORDED) >= 5000


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=[f"{n}-{i}" for i, (n, _) in enumerate(CONFIGS)])
def test_replayed_decisions_match_the_recorded_ones(index: int) -> None:
    recorded = RECORDED[index]
    fingerprint, outcomes = run(index)
    assert fingerprint == recorded["trace"], "the trace generator changed: record the fixture again"
    for step, (new, old) in enumerate(zip(outcomes, recorded["outcomes"], strict=True)):
        assert new == old, f"{recorded['policy']} {recorded['options']} step {step}: {new} != {old}"
