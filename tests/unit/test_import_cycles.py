"""The modules of kvstore_tiers import each other without a cycle.

Imports under ``if TYPE_CHECKING:`` and imports inside functions count: a
cycle there is still two modules that each need the other's concepts, so a
type lives with the protocol that owns it, and the graph stays a DAG.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = "kvstore_tiers"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: Path) -> dict[str, Path]:
    return {_module_name(p, root): p for p in sorted((root / PKG).rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The package module ``name`` is, or the nearest package that holds it."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every package module ``module`` imports, anywhere in its file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # ``from pkg import mod`` imports pkg.mod where it is a module.
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for name in names:
            target = _resolve(name, known)
            if target is not None and target != module and name.startswith(PKG):
                found.add(target)
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = _modules(root)
    edges = {m: _imports(m, p, known) for m, p in known.items()}
    # A package's __init__ that imports its own modules is no cycle with them.
    return {m: {t for t in ts if not m.startswith(f"{t}.")} for m, ts in edges.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle() -> None:
    found = cycles(graph())
    assert not found, "import cycles (TYPE_CHECKING and function-level imports count): " + \
        "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("guarded", [True, False])
def test_a_cycle_is_found(tmp_path: Path, guarded: bool) -> None:
    """The test can fail: two modules that import each other, one of them only
    for type checking, are a cycle."""
    pkg = tmp_path / PKG
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from kvstore_tiers.b import B\n")
    body = "from kvstore_tiers import a\n"
    if guarded:
        body = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"
    (pkg / "b.py").write_text(body)
    assert cycles(graph(tmp_path)) == [["kvstore_tiers.a", "kvstore_tiers.b"]]


def test_the_scheduler_side_knows_outcomes_not_job_classes() -> None:
    """The ledger applies summaries through one entry point per outcome, and a
    summary is condensed from per-slot lists: neither imports a job module."""
    edges = graph()
    for module in ("kvstore_tiers.ledger", "kvstore_tiers.outcome"):
        assert not edges[module] & {"kvstore_tiers.job", "kvstore_tiers.readthrough"}, module


def _identifiers(module: str) -> set[str]:
    """Every name a module's code uses or defines (not its comments or docstrings)."""
    path = _modules(ROOT)[module]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name)
    return names


LAYER_NAMES = ["admi", "read_through", "readthrough", "intake", "fill", "snapshot", "policy"]


@pytest.mark.parametrize("layer", LAYER_NAMES)
def test_the_transfer_core_knows_no_layer_composed_around_it(layer: str) -> None:
    """Admission and read-through are layers the tier composes around the store
    and load paths (a store filter, a load observer): the job, the pool, the
    summary and the ledger name neither; the tier reaches them only through
    its list of layers (kvstore_tiers.layer), and names neither either."""
    for module in ("kvstore_tiers.tier", "kvstore_tiers.layer", "kvstore_tiers.job",
                   "kvstore_tiers.pool", "kvstore_tiers.outcome", "kvstore_tiers.ledger"):
        named = sorted(n for n in _identifiers(module) if layer in n.lower())
        assert not named, f"{module} names {named}"


def test_backends_move_bytes_and_never_touch_a_frame() -> None:
    """What the bytes mean is the core's: no backend module (nor the memory
    plugin) imports the frame, the codecs or the cipher, anywhere in its file."""
    edges = graph()
    core = {"kvstore_tiers.frame", "kvstore_tiers.codecs", "kvstore_tiers.crypto",
            "kvstore_tiers.batching"}
    backends = [m for m in edges if m.startswith("kvstore_tiers.backends")]
    assert len(backends) > 10  # fs, redis, s3 and the contract itself
    touching = {m: sorted(edges[m] & core) for m in backends if edges[m] & core}
    assert not touching, touching
    known = _modules(ROOT)
    plugin = sorted((ROOT / "plugins" / "kvstore-memory" / "kvstore_memory").glob("*.py"))
    assert plugin
    for path in plugin:
        assert not _imports(f"kvstore_memory.{path.stem}", path, known) & core, path.name


def test_the_tier_imports_no_layer() -> None:
    """The tier's one composition point is ``assembly.layers``: it imports neither
    the admission module nor the read-through module (nor does the core below it)."""
    edges = graph()
    layers = {"kvstore_tiers.admission", "kvstore_tiers.readthrough", "kvstore_tiers.sketch"}
    for module in ("kvstore_tiers.tier", "kvstore_tiers.layer", "kvstore_tiers.job",
                   "kvstore_tiers.pool", "kvstore_tiers.outcome", "kvstore_tiers.ledger"):
        assert not edges[module] & layers, module


def test_the_name_check_can_fail() -> None:
    """Each name the check looks for is one the layers' own modules use."""
    used = {n.lower() for m in ("kvstore_tiers.admission", "kvstore_tiers.readthrough")
            for n in _identifiers(m)}
    for layer in LAYER_NAMES:
        assert any(layer in n for n in used), layer
