"""Usable CPUs: the affinity set narrowed by a cgroup quota (v2 cpu.max, v1 cfs files), from real files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lbd.common.cpus import cgroup_quota, usable_cpus


def _v2(root: Path, text: str) -> Path:
    (root / "cpu.max").write_text(text)
    return root


def test_no_cgroup_files_means_no_quota(tmp_path: Path) -> None:
    assert cgroup_quota(tmp_path) is None
    assert usable_cpus(tmp_path) == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(("text", "quota"), [("max 100000\n", None), ("150000 100000\n", 1.5),
                                             ("50000 100000", 0.5), ("bogus 100000", None)])
def test_cgroup_v2_quota(tmp_path: Path, text: str, quota: float | None) -> None:
    assert cgroup_quota(_v2(tmp_path, text)) == quota


def test_quota_rounds_up_and_never_raises_the_affinity(tmp_path: Path) -> None:
    assert usable_cpus(_v2(tmp_path, "50000 100000")) == 1  # half a CPU: one worker, not zero
    assert usable_cpus(_v2(tmp_path, f"{100000 * 512} 100000")) == len(os.sched_getaffinity(0))


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("250000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota(tmp_path) == 2.5
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no limit"
    assert cgroup_quota(tmp_path) is None
