"""A rank's process tree from the kernel's child lists: the same processes psutil's full scan finds."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from lbd.supervisor.proctree import descendants

# A launcher that starts one child from its main thread and one from another thread; the first child starts
# a grandchild. Each prints its pid, then everyone sleeps until killed.
_TREE = """
import subprocess, sys, threading, time
SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
NEST = [sys.executable, "-c", "import subprocess, sys, time; p = subprocess.Popen(%r); print(p.pid, flush=True); "
        "time.sleep(60)" % (SLEEP,)]
a = subprocess.Popen(NEST, stdout=subprocess.PIPE, text=True)
grand = a.stdout.readline().strip()
out = []
t = threading.Thread(target=lambda: out.append(subprocess.Popen(SLEEP)))
t.start(); t.join()
print(a.pid, grand, out[0].pid, flush=True)
time.sleep(60)
"""


@pytest.fixture(scope="module")
def tree():
    root = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in root.stdout.readline().split()]  # type: ignore[union-attr]
        yield root.pid, pids
    finally:
        procs = [psutil.Process(root.pid), *psutil.Process(root.pid).children(recursive=True)]
        for p in procs:
            p.kill()
        psutil.wait_procs(procs, timeout=10)


def test_descendants_match_a_full_scan(tree: tuple[int, list[int]]) -> None:
    root, started = tree
    found = [p.pid for p in descendants(root)]
    assert found[0] == root
    assert sorted(found[1:]) == sorted(started)  # the thread's child and the grandchild too
    assert sorted(found) == sorted([root, *(p.pid for p in psutil.Process(root).children(recursive=True))])


def test_a_process_that_is_gone_has_no_tree() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    deadline = time.monotonic() + 5
    while psutil.pid_exists(p.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert descendants(p.pid) == []
