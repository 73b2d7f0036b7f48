"""How many CPUs this process may use: its affinity set, narrowed by a cgroup CPU quota (a Kubernetes
container's ``limits.cpu``), as nginx's ``worker_processes auto`` counts cores and Go's automaxprocs reads the
quota. Used for defaults that scale with the machine (``lbd route --workers auto``)."""

from __future__ import annotations

import math
import os
from pathlib import Path

_CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs the cgroup's quota allows (quota / period), or None without a quota."""
    try:
        v2 = (root / "cpu.max").read_text().split()
    except OSError:
        v2 = []
    if len(v2) == 2 and v2[0] != "max":
        return _ratio(v2[0], v2[1])
    try:
        quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
        period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def usable_cpus(root: Path = Path("/sys/fs/cgroup")) -> int:
    """The affinity set's size, at most the quota rounded up (a 1.5-CPU limit gives 2), at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    quota = cgroup_quota(root)
    if quota is not None:
        n = min(n, math.ceil(quota))
    return max(1, n)
