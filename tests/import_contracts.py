"""An import-linter contract type for a row of ARCHITECTURE.md's package table: "this package may import only
these packages of ours, and (optionally) only these outside packages".

import-linter's own types say what a package must *not* import (``forbidden``) or who may import it
(``protected``); a row of the table is an allow-list, so a package added tomorrow is refused until the table
names it. Every direct import counts, lazy and ``TYPE_CHECKING`` ones included (grimp reads them all).
The standard library is always allowed. Used from pyproject.toml's ``[tool.importlinter]``; run with
``PYTHONPATH=tests lint-imports`` (tests/test_architecture.py does).
"""

from __future__ import annotations

import sys

import grimp
from importlinter import Contract, ContractCheck, fields, output


def _within(module: str, packages: list[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


class AllowedImportsContract(Contract):
    """Options: ``source_modules`` (packages), ``allowed_modules`` (packages of ours they may import, besides
    themselves), ``allowed_external`` (outside top-level packages they may import; omitted = any)."""

    type_name = "allowed_imports"

    source_modules = fields.ListField(subfield=fields.StringField())
    allowed_modules = fields.ListField(subfield=fields.StringField(), required=False)
    allowed_external = fields.ListField(subfield=fields.StringField(), required=False)

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        (root,) = self.session_options["root_packages"]
        allowed = list(self.allowed_modules or [])
        external = self.allowed_external
        violations = []
        for source in self.source_modules:
            if source not in graph.modules:
                raise ValueError(f"{self.name}: {source} is not a module of {root}")
            for importer in sorted(m for m in graph.modules if _within(m, [source])):
                for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                    if self._allowed(imported, source, root, allowed, external):
                        continue
                    lines = [d["line_number"] for d in graph.get_import_details(importer=importer,
                                                                                 imported=imported)]
                    violations.append((importer, imported, lines))
        return ContractCheck(kept=not violations, metadata={"violations": violations})

    @staticmethod
    def _allowed(imported: str, source: str, root: str, allowed: list[str],
                 external: list[str] | None) -> bool:
        if _within(imported, [source]) or imported in sys.stdlib_module_names:
            return True
        if imported == root or imported.startswith(root + "."):
            return _within(imported, allowed)
        return external is None or imported.split(".")[0] in external

    def render_broken_contract(self, check: ContractCheck) -> None:
        for importer, imported, lines in check.metadata["violations"]:
            where = ", ".join(f"l.{n}" for n in lines)
            output.print_error(f"{importer} -> {imported} ({where})", bold=False)
        output.new_line()
        output.print(f"{', '.join(self.source_modules)} may import "
                     f"{', '.join(self.allowed_modules or []) or 'nothing of ours'}"
                     + ("" if self.allowed_external is None else
                        f" and, outside, only {', '.join(self.allowed_external) or 'the standard library'}")
                     + ": see ARCHITECTURE.md's package table.")
