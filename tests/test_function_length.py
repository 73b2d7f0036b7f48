"""No function in src/lbd is longer than 60 lines, argument tables excepted.

A long function is where a newcomer loses the thread; split it into named steps. An argument table (a
parser's flags, a metric registry) reads as a list, not as logic, so it may run longer: such a function is
listed in TABLES, and the test checks it still is one (mostly calls, no branches).
"""

from __future__ import annotations

import ast
from pathlib import Path

import lbd

SRC = Path(lbd.__file__).resolve().parent
MAX_LINES = 60
# Argument tables, by "module:function": parsers' add_argument lists and metric declarations.
TABLES = {
    "lbd.bench.cli:make_parser",
    "lbd.engine.config.args:add_engine_arguments",
    "lbd.router.flags:make_parser",
    "lbd.supervisor.flags:add_supervisor_arguments",
}


def _functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        module = "lbd." + ".".join(path.relative_to(SRC).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((f"{module}:{node.name}", node))
    return out


def _is_table(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Mostly plain calls and assignments of calls, and no loops or branches of its own."""
    body = fn.body[1:] if ast.get_docstring(fn) else fn.body
    calls = sum(isinstance(s, (ast.Expr, ast.Assign, ast.AnnAssign)) and isinstance(s.value, ast.Call)
                for s in body)
    branches = sum(isinstance(s, (ast.If, ast.For, ast.While, ast.Try, ast.With)) for s in body)
    return calls >= 0.6 * len(body) and branches <= 2


def test_no_function_is_longer_than_60_lines() -> None:
    long = [f"{name} ({fn.end_lineno - fn.lineno + 1} lines)" for name, fn in _functions()
            if fn.end_lineno - fn.lineno + 1 > MAX_LINES and name not in TABLES]
    assert not long, "split these into named steps:\n" + "\n".join(long)


def test_listed_tables_are_tables() -> None:
    found = {name: fn for name, fn in _functions() if name in TABLES}
    assert set(found) == TABLES, f"listed but gone: {sorted(TABLES - set(found))}"
    assert [name for name, fn in found.items() if not _is_table(fn)] == []
