"""A rank's process tree, read from the kernel's per-thread child lists instead of a scan of every process.

psutil's ``children(recursive=True)`` reads ``/proc/<pid>/stat`` of every process on the machine to learn
their parents; on a node of many ranks that is several milliseconds of the supervisor's event loop, paid on
every stop, kill and ready of a rank. ``/proc/<pid>/task/<tid>/children`` (Linux with
CONFIG_PROC_CHILDREN) names a thread's children directly, so walking a rank's tree reads only that tree.
Where the file does not exist, psutil's scan is used: the answer is the same set either way.
"""

from __future__ import annotations

import contextlib
import os

import psutil


def descendants(pid: int) -> list[psutil.Process]:
    """``pid`` first, then every process under it; [] when ``pid`` is gone."""
    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return []
    pids = _descendant_pids(pid)
    if pids is None:  # no per-thread child lists on this kernel
        try:
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []
    found = [root]
    for child in pids:
        with contextlib.suppress(psutil.Error):
            found.append(psutil.Process(child))
    return found


def _descendant_pids(pid: int) -> list[int] | None:
    """Every pid under ``pid``, breadth first; None when the kernel has no per-thread child lists."""
    if not os.path.exists(f"/proc/{pid}/task/{pid}/children"):
        return None if os.path.exists(f"/proc/{pid}") else []
    found: list[int] = []
    queue = [pid]
    while queue:
        parent = queue.pop(0)
        for child in _children(parent):
            if child not in found:
                found.append(child)
                queue.append(child)
    return found


def _children(pid: int) -> list[int]:
    """The children of every thread of ``pid`` (a process that is gone has none)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue  # the thread or process ended meanwhile
    return out
