"""The import graph of ``src/muonclip``, read with ``ast`` (nothing is imported).

Used by ``test_architecture.py``; run as a script it prints the numbers of the architecture
drawing: ``python tests/import_graph.py [SRC]``.

* modules: the ``.py`` files of the package.
* arrows: pairs of subpackages (a, b), a != b, where a module of a imports one of b.
* floors: the most subpackages on one chain of arrows (a subpackage that imports no other is
  on the ground floor; cycles counted once, through their strongly connected component).
* circles: cycles between subpackages, and groups of modules that import each other (strongly
  connected components of the module graph with more than one module); ``lazy=False``
  leaves out imports inside functions (those run when called, not when the module loads).
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "muonclip"


def module_name(path: Path, src: Path = SRC) -> str:
    """Dotted module name of ``path`` (a package's ``__init__.py`` is the package)."""
    parts = path.relative_to(src.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """The statements that run when the module loads (not the bodies of functions)."""
    out: list[ast.stmt] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        out.append(node)
        for field in ("body", "orelse", "finalbody", "handlers"):
            todo.extend(getattr(node, field, []) or [])
    return out


def imports(path: Path, src: Path = SRC, lazy: bool = True) -> set[str]:
    """The muonclip modules that ``path`` imports, dotted: ``from x import y`` is module ``x.y``
    when that is a module, else ``x`` (whose code defines y). ``lazy=False``: only imports
    that run when the module loads."""
    known = set(_modules(src))
    is_package = path.name == "__init__.py"
    package = module_name(path, src) if is_package else module_name(path, src).rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = ast.walk(tree) if lazy else _top_level(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            subs = {f"{module}.{a.name}" for a in node.names}
            found |= subs & known
            if subs - known:  # a name defined in the module (or package) itself: it runs
                found.add(module)
    return {m for m in found if m == "muonclip" or m.startswith("muonclip.")}


@cache
def _modules(src: Path) -> dict[str, Path]:
    return {module_name(p, src): p for p in sorted(src.rglob("*.py"))}


def subpackage(module: str, src: Path = SRC) -> str | None:
    """The subpackage (first name under muonclip) a module belongs to; None for the root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (src / parts[1]).is_dir() else None


def subpackages(src: Path = SRC) -> set[str]:
    """Every subpackage (a folder with an ``__init__.py``)."""
    return {p.parent.name for p in src.glob("*/__init__.py")}


def subpackage_graph(src: Path = SRC, lazy: bool = True) -> dict[str, set[str]]:
    """Subpackage -> the other subpackages its modules import (every subpackage is a key)."""
    graph: dict[str, set[str]] = {s: set() for s in subpackages(src)}
    for name, path in _modules(src).items():
        here = subpackage(name, src)
        if here is None:
            continue  # muonclip/__init__.py: the package root wires the layers together
        graph[here] |= {subpackage(m, src) for m in imports(path, src, lazy)} - {None, here}
    return graph


def module_graph(src: Path = SRC, lazy: bool = True) -> dict[str, set[str]]:
    """Module -> the muonclip modules it imports (importing ``a.b`` also runs package ``a``)."""
    mods = _modules(src)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = set()
        for m in imports(path, src, lazy):
            if m in mods:
                targets.add(m)
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every simple cycle, as the path from its smallest node back to it."""
    found = []

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == path[0]:
                found.append(path + [nxt])
            elif nxt not in path and nxt > path[0]:
                walk(nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, [start])
    return found


def components(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each subpackage's floor: 1 + the highest floor it imports (1: imports no other); the
    members of a cycle share one floor."""
    comp_of = {v: frozenset({v}) for v in graph}
    for comp in components(graph):
        for v in comp:
            comp_of[v] = frozenset(comp)
    level: dict[frozenset, int] = {}

    def height(c: frozenset) -> int:
        if c not in level:
            level[c] = 0  # guard; components have no cycles between them
            below = {comp_of[w] for v in c for w in graph.get(v, ())} - {c}
            level[c] = 1 + max((height(b) for b in below), default=0)
        return level[c]

    return {v: height(comp_of[v]) for v in graph}


def summary(src: Path = SRC) -> dict[str, int]:
    """The drawing's numbers (see the module docstring)."""
    sub = subpackage_graph(src)
    mods = module_graph(src)
    return {
        "modules": len(_modules(src)),
        "subpackages": len(sub),
        "arrows": sum(len(v) for v in sub.values()),
        "floors": max(floors(sub).values(), default=0),
        "subpackage circles": len(cycles(sub)),
        "module circles (any import)": len(components(mods)),
        "module circles (at load)": len(components(module_graph(src, lazy=False))),
    }


if __name__ == "__main__":
    root = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else SRC
    for key, value in summary(root).items():
        print(f"{key}: {value}")
    sub = subpackage_graph(root)
    fl = floors(sub)
    for s in sorted(sub, key=lambda s: (fl[s], s)):
        print(f"  floor {fl[s]}: {s} -> {', '.join(sorted(sub[s])) or '-'}")
    for comp in components(module_graph(root)):
        print("  module circle:", ", ".join(sorted(comp)))
    for c in cycles(sub):
        print("  subpackage circle:", " -> ".join(c))
