"""docs/architecture.md names every module of the package with its one job,
and the layering holds: the tier library imports nothing from the tools or
the CLI, and backends never import the namespace's identity or the core's
scheduler side."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "kvstore_tiers"
DOC = ROOT / "docs" / "architecture.md"
#: Packages covered by one row as a whole: not the tier library.
WHOLE = ("cli", "tools")


def _rows() -> list[str]:
    text = DOC.read_text()
    section = text.split("## Where the code lives", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| `")]


def _modules() -> list[Path]:
    files = [*PKG.rglob("*.py"), *PKG.rglob("*.c")]
    return sorted(p.relative_to(PKG) for p in files
                  if p.name != "__init__.py" and p.relative_to(PKG).parts[0] not in WHOLE)


def _named(module: Path, rows: list[str]) -> bool:
    first_cell = re.compile(r"^\| ([^|]+) \|")
    for row in rows:
        cell = first_cell.match(row)
        if cell is None:
            continue
        named = re.findall(r"`([^`]+)`", cell.group(1))
        if str(module) in named:
            return True
        package = f"{module.parent}/"
        if package in named and re.search(rf"`{re.escape(module.name)}`", row):
            return True
    return False


def test_every_module_has_its_row() -> None:
    rows = _rows()
    missing = [str(m) for m in _modules() if not _named(m, rows)]
    assert not missing, f"modules without a row in docs/architecture.md: {missing}"


def test_every_row_names_a_module_that_exists() -> None:
    for row in _rows():
        first = row.split("|")[1]
        for name in re.findall(r"`([^`]+)`", first):
            assert (PKG / name).exists(), f"docs/architecture.md names {name}, which is gone"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


@pytest.mark.parametrize("path", sorted(p for p in PKG.rglob("*.py")
                                        if p.relative_to(PKG).parts[0] not in WHOLE),
                         ids=lambda p: str(p.relative_to(PKG)))
def test_the_library_imports_nothing_from_tools_or_cli(path: Path) -> None:
    bad = {m for m in _imports(path) if m.startswith(("kvstore_tiers.tools", "kvstore_tiers.cli"))}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", sorted((PKG / "backends").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(PKG)))
def test_backends_import_only_what_is_below_them(path: Path) -> None:
    above = ("kvstore_tiers.namespace", "kvstore_tiers.fingerprint", "kvstore_tiers.tier",
             "kvstore_tiers.ledger", "kvstore_tiers.job", "kvstore_tiers.outcome",
             "kvstore_tiers.pool", "kvstore_tiers.admission", "kvstore_tiers.assembly")
    bad = {m for m in _imports(path) if m.startswith(above)}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
