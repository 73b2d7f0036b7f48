"""The layering of ARCHITECTURE.md, checked: the import contracts hold (import-linter, lazy and
TYPE_CHECKING imports included), the package table says what the contracts say, and the router and the
supervisor run without torch, transformers or triton (their real entry points, serving a request, read with
-X importtime)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest

from support.node import ENGINE_FLAGS
from support.procs import free_port, free_port_run, spawn, stop, wait_http

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "triton")


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    run = subprocess.run([str(lint), "--no-cache", "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])])},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert f"{len(_contracts())} kept, 0 broken" in run.stdout, run.stdout[-3000:]


def _table() -> dict[str, tuple[str, str]]:
    """ARCHITECTURE.md's package table: package -> (may import (ours), outside packages)."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text[text.index("## Packages and what each may import"):]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"`lbd[\w.]*`", cells[0]):
            rows[cells[0].strip("`")] = (cells[2], cells[3])
    return rows


def _names(cell: str) -> set[str]:
    return set(re.findall(r"`([\w.]+)`", cell))


def test_package_table_and_contracts_say_the_same() -> None:
    table = _table()
    assert set(table) >= {"lbd.serve", "lbd.router", "lbd.supervisor", "lbd.engine", "lbd.kernels",
                          "lbd.policies", "lbd.common"}, table
    allowed = {c["source_modules"][0]: c for c in _contracts() if c["type"] == "allowed_imports"}
    assert all(len(c["source_modules"]) == 1 for c in allowed.values())
    rows = {p: cells for p, cells in table.items() if p != "lbd.cli"}  # cli loads programs by name only
    assert set(allowed) == set(rows), "a row without a contract, or a contract without a row"
    banned_by_table: dict[str, set[str]] = {}
    for package, (ours, outside) in rows.items():
        contract = allowed[package]
        assert _names(ours) == set(contract.get("allowed_modules", [])), package
        if outside.startswith("only"):
            assert set(contract["allowed_external"]) == _names(outside), package
        elif outside == "none":
            assert contract["allowed_external"] == [], package
        else:
            assert outside.startswith("any") and "allowed_external" not in contract, package
            if outside.startswith("any but"):
                banned_by_table[package] = _names(outside)
    forbidden = [c for c in _contracts()
                 if c["type"] == "forbidden" and set(c["forbidden_modules"]) == set(HEAVY)]
    assert len(forbidden) == 1
    assert set(forbidden[0]["source_modules"]) == set(banned_by_table)
    assert all(names == set(HEAVY) for names in banned_by_table.values())


# ---- read from the source: policies hold no I/O; one module changes what the router knows of an endpoint
SRC = ROOT / "src" / "lbd"
# What a policy may not import: I/O of every kind (network, files, processes and threads, logging, the
# console) and clocks and sleeps. A decision is a function of its inputs: the router passes the time in (a
# snapshot's age_s) and does the I/O; the policies read no clock today, not even time.monotonic.
# (importlib stays allowed: the registry imports its own plugin modules by name.)
POLICY_IO_MODULES = frozenset({
    "aiohttp", "asyncio", "concurrent", "datetime", "fcntl", "glob", "http", "httptools", "httpx", "io",
    "logging", "mmap", "multiprocessing", "os", "pathlib", "pickle", "requests", "sched", "select",
    "selectors", "shelve", "shutil", "signal", "socket", "sqlite3", "ssl", "subprocess", "sys", "tempfile",
    "threading", "time", "urllib", "uvloop", "zmq",
})
POLICY_IO_CALLS = frozenset({"open", "print", "input", "breakpoint", "exec", "eval", "__import__"})


def _io_uses(source: str) -> list[str]:
    """Where ``source`` imports an I/O or clock module, lazily or not, or calls a builtin that does I/O."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in POLICY_IO_CALLS:
            found.append(f"line {node.lineno}: calls {ast.unparse(node.func)}()")
            continue
        else:
            continue
        found += [f"line {node.lineno}: imports {n}" for n in names if n.split(".")[0] in POLICY_IO_MODULES]
    return found


def test_policies_hold_no_io() -> None:
    """No module of lbd.policies imports an I/O or clock module (POLICY_IO_MODULES) or calls open(), print()
    and the like: decisions stay pure functions of (facts, snapshots, the policy's explicit state)."""
    files = sorted((SRC / "policies").rglob("*.py"))
    assert len(files) > 10, files
    found = {str(p.relative_to(ROOT)): uses for p in files if (uses := _io_uses(p.read_text()))}
    assert found == {}, f"I/O or clocks in the policies: {found}"
    probe = "import math\nimport os.path\ndef f():\n    from time import monotonic\n    open('x')\n"
    assert _io_uses(probe) == ["line 2: imports os.path", "line 4: imports time", "line 5: calls open()"]


# Attributes of other types that share a name with an Endpoint field (that type: why it is not an endpoint).
NOT_ENDPOINT_WRITES = {
    ("kv/view.py", "view.source"),  # EndpointView.source: the KV-event publisher it follows
    ("telemetry.py", "s.models"),  # Sample.models: the parser fills the sample it builds
    ("upstream.py", "self.pool.waiting"),  # the connection pool's waiters
}
_MUTATORS = frozenset({"add", "append", "clear", "discard", "extend", "insert", "pop", "popitem", "remove",
                       "reverse", "setdefault", "sort", "update"})


def _endpoint_fields() -> set[str]:
    """The fields of lbd.router.endpoints.Endpoint, read from its class body."""
    tree = ast.parse((SRC / "router" / "endpoints.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Endpoint")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _field_writes(source: str, fields: set[str]) -> list[tuple[int, str]]:
    """Where ``source`` changes an attribute named like one of ``fields`` on anything but ``self``: assigns,
    augments or deletes it, sets or deletes an item of it, calls a mutating method of it (``.pop``,
    ``.clear``, ...), or ``setattr``s it."""
    found: list[tuple[int, str]] = []

    def changed(node: ast.expr) -> None:
        if isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                changed(elt)
            return
        if isinstance(node, ast.Starred):
            node = node.value
        while isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, ast.Attribute) and node.attr in fields and not _is_self(node.value):
            found.append((node.lineno, ast.unparse(node)))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Assign, ast.Delete)):
            for target in node.targets:
                changed(target)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor, ast.comprehension)):
            changed(node.target)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            changed(node.optional_vars)
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _MUTATORS:
                changed(func.value)
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            args = node.args
            if name in ("setattr", "delattr", "__setattr__", "__delattr__") and len(args) >= 2 and \
                    isinstance(args[1], ast.Constant) and args[1].value in fields and not _is_self(args[0]):
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def test_one_module_changes_what_the_router_knows_of_an_endpoint() -> None:
    """lbd.router.endpoints (its Fleet) is the only code that changes an Endpoint: nowhere else under
    lbd/router is an attribute named like an Endpoint field changed on anything but ``self`` (the sources
    call the fleet's methods: observe, fail, eject, readmit, supervise, ...)."""
    fields = _endpoint_fields()
    assert {"healthy", "sample", "waiting", "trial", "models"} <= fields, fields
    router = SRC / "router"
    found = []
    for path in sorted(router.rglob("*.py")):
        rel = str(path.relative_to(router))
        if rel == "endpoints.py":
            continue
        found += [f"{rel}:{line} {what}" for line, what in _field_writes(path.read_text(), fields)
                  if (rel, what) not in NOT_ENDPOINT_WRITES]
    assert found == [], f"Endpoint fields changed outside lbd.router.endpoints (call a Fleet method): {found}"
    probe = "ep.healthy = False\nself.healthy = True\na.ep.waiting[k] = 1\nep.failures_by.clear()\n" \
            "x, ep.rank = 1, 2\nsetattr(ep, 'trial', None)\nep.other = 1\n"
    assert [line for line, _ in _field_writes(probe, fields)] == [1, 3, 4, 5, 6]


def _imported(log: str) -> set[str]:
    """Top-level names of every module a process imported, from its -X importtime lines."""
    return {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in log.splitlines()
            if line.startswith("import time:") and "|" in line}


def test_router_and_supervisor_run_without_torch(tiny_llama: Path, tmp_path: Path) -> None:
    """`lbd supervise` with a CPU rank and `lbd route` over it, each under -X importtime, answer a
    completion; neither process ever imported torch, transformers or triton (the rank does, on its own)."""
    base = free_port_run(2)
    sup_log, router_log = tmp_path / "supervise.log", tmp_path / "route.log"
    supervise = spawn([sys.executable, "-X", "importtime", "-m", "lbd", "supervise",
                       "--data-parallel-multi-port-external-lb", "--data-parallel-size", "1", "--host",
                       "127.0.0.1", "--port", str(base), "--supervisor-host", "127.0.0.1",
                       "--data-parallel-supervisor-port", str(base + 1), "--model", str(tiny_llama),
                       *ENGINE_FLAGS], log=sup_log)
    port = free_port()
    route = spawn([sys.executable, "-X", "importtime", "-m", "lbd", "route", "--host", "127.0.0.1", "--port",
                   str(port), "--upstreams", f"supervisor://127.0.0.1:{base + 1}"], log=router_log)
    try:
        wait_http(f"http://127.0.0.1:{base + 1}/readyz", timeout=120, proc=supervise)
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout=60, proc=route)
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                            json={"model": str(tiny_llama), "prompt": "Hello", "max_tokens": 4})
        assert answer.status_code == 200, answer.text
    finally:
        stop(route)
        stop(supervise)
    for name, log in (("lbd supervise", sup_log), ("lbd route", router_log)):
        modules = _imported(log.read_text(errors="replace"))
        assert "lbd" in modules and "uvloop" in modules, (name, sorted(modules))  # the log is complete
        assert not modules & set(HEAVY), (name, sorted(modules & set(HEAVY)))


@pytest.mark.parametrize("program", ["lbd.router.cli", "lbd.supervisor.cli", "lbd.serve.plan"])
def test_programs_import_without_heavy_modules(program: str) -> None:
    code = f"import sys, {program}; print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_no_script_or_test_module_shadows_another_package() -> None:
    """A script's folder comes first on sys.path (and pytest puts each test folder there): a file named like
    an installed package, the standard library, or supervisord's and Hugging Face's packages (which users
    have beside lbd) hides that package from everything the script imports."""
    import importlib.metadata

    taken = {*importlib.metadata.packages_distributions(), *sys.stdlib_module_names, "kernels", "supervisor"}
    files = [p for folder in ("benchmarks", "scripts", "tests") for p in (ROOT / folder).rglob("*.py")]
    clashes = sorted(str(p.relative_to(ROOT)) for p in files if p.stem in taken)
    assert not clashes, f"rename these, their names are other packages' import names: {clashes}"


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_level_import_cycles() -> None:
    """No two modules of lbd reach each other through imports, lazy ones inside functions included (grimp
    reads them all). The ``no import cycles`` contract squashes each package into one node per level; this
    sees every module, a package's ``__init__`` and its children too. Imports the contract ignores are
    left out here as well."""
    import grimp

    contract = next(c for c in _contracts() if c["type"] == "acyclic_siblings")
    ignored = {tuple(s.split(" -> ")) for s in contract.get("ignore_imports", [])}
    graph = grimp.build_graph("lbd", cache_dir=None)
    edges = {m: {i for i in graph.find_modules_directly_imported_by(m) if (m, i) not in ignored}
             for m in graph.modules}
    assert _cycles(edges) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _chunk_readers(node: ast.AST, scope: str) -> set[str]:
    """The functions under ``node`` (dotted names below ``scope``) that touch an upstream stream's chunks:
    ``.read_chunk``, by attribute or by name; a nested function counts as itself."""
    found = set()
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found |= _chunk_readers(child, f"{scope}.{child.name}")
            continue
        if (isinstance(child, ast.Attribute) and child.attr == "read_chunk") or (
            isinstance(child, ast.Constant) and child.value == "read_chunk"
        ):
            found.add(scope)
        found |= _chunk_readers(child, scope)
    return found


def test_one_pump_reads_the_router_s_upstream_streams() -> None:
    """Exactly one function of lbd.router reads an upstream's answer chunk by chunk: the pump
    (lbd.router.relay.Relay.stream), which plain streams and resumable ones (lbd.router.resumable) share, each
    with its own tap. Two pumps did one job once (issue 42); a second one would drift from the first in its
    idle timeouts, client-gone handling or metrics. The upstream client (lbd.router.upstream) defines
    ``read_chunk`` and reads whole bodies with it; it is not a pump."""
    src = ROOT / "src"
    readers: set[str] = set()
    for path in sorted((src / "lbd" / "router").rglob("*.py")):
        module = ".".join(path.relative_to(src).with_suffix("").parts)
        if module != "lbd.router.upstream":
            readers |= _chunk_readers(ast.parse(path.read_text(), str(path)), module)
    assert readers == {"lbd.router.relay.Relay.stream"}
    copy = "class P:\n    async def pump(self, up):\n        while await up.read_chunk():\n            pass\n"
    assert _chunk_readers(ast.parse(copy), "m") == {"m.P.pump"}  # (the check sees a copy)
