"""No module of lbd imports another module's private names (``from m import _x``): a name with a leading
underscore is its module's own business, free to change without a look at anyone else. What two modules share
gets a public name in the module that owns it. Dunders (``__version__``) and ``from __future__`` are public.
Lazy imports inside functions and ``TYPE_CHECKING`` blocks count too (the whole tree is walked)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, here: str, is_package: bool) -> str:
    """The module an ``ImportFrom`` reads from, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_imports(path: Path, root: Path = SRC) -> list[str]:
    """``file:line: from m import _x`` for each private name ``path`` (under ``root``, the folder of the top
    package) imports from another module."""
    here, where = _module_name(path, root), path.relative_to(root)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(node, here, path.name == "__init__.py")
            if source == here:
                continue
            if any(_private(part) for part in source.split(".")):
                found.append(f"{where}:{node.lineno}: from {source} import ...")
            found += [f"{where}:{node.lineno}: from {source} import {a.name}"
                      for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Import):
            found += [f"{where}:{node.lineno}: import {a.name}" for a in node.names
                      if any(_private(part) for part in a.name.split("."))]
    return found


def test_no_module_imports_another_modules_private_names() -> None:
    found = {line.split(":")[0] + ":" + line.split(":", 2)[2]: line
             for path in sorted((SRC / "lbd").rglob("*.py")) for line in private_imports(path)}
    new = sorted(found.values())
    assert not new, "give these names a public spelling where they live:\n" + "\n".join(new)


def test_the_check_sees_absolute_relative_and_lazy_imports(tmp_path: Path) -> None:
    """The walker itself, on a package written for it."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from __future__ import annotations\nfrom pkg.b import _hidden, shown, __version__\n"
        "from . import a\nfrom .a import _own\n"
        "def f():\n    from .b import _lazy\n    import pkg._private_mod\n")
    assert private_imports(pkg / "a.py", tmp_path) == [
        "pkg/a.py:2: from pkg.b import _hidden", "pkg/a.py:6: from pkg.b import _lazy",
        "pkg/a.py:7: import pkg._private_mod"]
