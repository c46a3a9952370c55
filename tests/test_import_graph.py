"""The package's import graph is one-way: no cycle between folders, and kernels/ never imports the model.

Every ``.py`` under the package's source folders is parsed with :mod:`ast` (no import runs), folders are mapped
to their import names through ``[tool.setuptools] package-dir`` in pyproject.toml, and every ``import`` /
``from ... import`` is counted, including those inside functions. A folder is a sub-package of ``k3rocm``
(``k3rocm.model``, ``k3rocm.runtime``, ``k3rocm.kernels``, ...; its own sub-packages belong to it); the
top-level modules of ``k3rocm`` (``k3rocm.config``, ``k3rocm.errors``, ...) form the folder ``k3rocm``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "k3rocm"

# Folder edges allowed to close a cycle, each (importer, imported): none. An entry is only a stopgap while a
# cycle is being removed; the test fails on an entry that no longer exists or no longer closes a cycle.
# kernels -> model is never allowed (test_kernels_import_nothing_from_the_model).
KNOWN_CYCLE_EDGES: frozenset[tuple[str, str]] = frozenset()


def _package_dirs() -> dict[str, Path]:
    """Import name -> source folder, from pyproject's package-dir."""
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return {name: ROOT / d for name, d in doc["tool"]["setuptools"]["package-dir"].items()}


def _modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file (``pkg/__init__.py`` is ``pkg``)."""
    mods: dict[str, Path] = {}
    for name, folder in _package_dirs().items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("").parts
            if rel[-1] == "__init__":
                rel = rel[:-1]
            mod = ".".join((name, *rel))
            mods.setdefault(mod, path)  # a sub-package with its own package-dir entry wins over its parent's copy
    return mods


def _is_package(mod: str, mods: dict[str, Path]) -> bool:
    return mod in mods and mods[mod].name == "__init__.py"


def _folder(mod: str, mods: dict[str, Path]) -> str:
    """``k3rocm.<sub>`` for a module in a sub-package of k3rocm, else ``k3rocm``."""
    parts = mod.split(".")
    if len(parts) >= 2 and _is_package(".".join(parts[:2]), mods):
        return ".".join(parts[:2])
    return PACKAGE


def _imports(mod: str, path: Path, mods: dict[str, Path]) -> list[tuple[str, int]]:
    """The package modules ``mod`` imports, with line numbers (imports inside functions included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    here = mod if _is_package(mod, mods) else mod.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:  # ``from pkg import submodule`` imports the submodule
                sub = f"{target}.{a.name}"
                out.append((sub if sub in mods else target, node.lineno))
    return [(t, line) for t, line in out if t == PACKAGE or t.startswith(PACKAGE + ".")]


def _edges() -> dict[tuple[str, str], list[str]]:
    """(importer folder, imported folder) -> ``file:line`` of each import that makes the edge."""
    mods = _modules()
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for mod, path in mods.items():
        src = _folder(mod, mods)
        for target, line in _imports(mod, path, mods):
            dst = _folder(target, mods)
            site = f"{path.relative_to(ROOT)}:{line} ({target})"
            if dst != src and site not in edges[(src, dst)]:
                edges[(src, dst)].append(site)
    return dict(edges)


def _cycles(edges) -> list[list[str]]:
    """Strongly connected components of more than one folder (Tarjan)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def _report(comps, edges) -> str:
    lines = []
    for comp in comps:
        lines.append("cycle between " + ", ".join(comp) + ":")
        for (a, b), sites in sorted(edges.items()):
            if a in comp and b in comp:
                lines.append(f"  {a} -> {b}: " + "; ".join(sites[:5]) + (" ..." if len(sites) > 5 else ""))
    return "\n".join(lines)


def test_the_walk_sees_every_folder():
    mods = _modules()
    folders = {_folder(m, mods) for m in mods}
    assert {"k3rocm", "k3rocm.model", "k3rocm.runtime", "k3rocm.kernels", "k3rocm.validation", "k3rocm.cli",
            "k3rocm.checkpoint", "k3rocm.bench"} <= folders, folders
    assert "k3rocm.kernels.kda.prefill" in mods and "k3rocm.cli.main" in mods
    # an import inside a function counts: the walk must find at least one such edge in this package
    assert any(isinstance(n, (ast.Import, ast.ImportFrom))
               for p in mods.values() for f in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
               if isinstance(f, ast.FunctionDef) for n in ast.walk(f))


def test_kernels_import_nothing_from_the_model():
    bad = {k: v for k, v in _edges().items() if k == ("k3rocm.kernels", "k3rocm.model")}
    assert not bad, "kernels/ imports the model: " + "; ".join(bad.get(("k3rocm.kernels", "k3rocm.model"), []))


def test_no_cycle_between_folders():
    edges = _edges()
    stale = sorted(e for e in KNOWN_CYCLE_EDGES if e not in edges)
    assert not stale, f"KNOWN_CYCLE_EDGES lists edges that no longer exist; remove them: {stale}"
    comps = _cycles({e: s for e, s in edges.items() if e not in KNOWN_CYCLE_EDGES})
    assert not comps, _report(comps, edges)
    # every allowed edge must still be part of a cycle, or it is not a known cycle edge but an ordinary one
    known = _cycles(edges)
    loose = sorted(e for e in KNOWN_CYCLE_EDGES if not any(e[0] in c and e[1] in c for c in known))
    assert not loose, f"KNOWN_CYCLE_EDGES lists edges that no longer close a cycle; remove them: {loose}"
