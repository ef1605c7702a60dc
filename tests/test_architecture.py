"""The layout of the package: what may import what, and where the core's update is.

Every import in ``src/muonclip`` (module level or inside a function, absolute or relative) is
read with ``ast``; a test fails on a cycle between subpackages and on any import from the core
(``ortho``, ``optim``) to a layer built on it. Then, the core's extension point: one process
never enters the distributed layer, and a step that needs it without it is an error.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import muonclip
from muonclip.optim import distribution as engine_mod

SRC = Path(__file__).resolve().parents[1] / "src" / "muonclip"
CORE = ("ortho", "optim")
LAYERS = ("distributed", "fast", "qkclip", "attention", "integrations", "cli", "models", "data")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The muonclip modules that ``path`` imports, as dotted names."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)  # `from . import x` names a module
    return {m for m in found if m == "muonclip" or m.startswith("muonclip.")}


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (SRC / parts[1]).is_dir() else None


def subpackage_graph() -> dict[str, set[str]]:
    """Subpackage -> the other subpackages its modules import."""
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        src = _subpackage(_module_name(path))
        if src is None:
            continue  # muonclip/__init__.py: the package root wires the layers together
        targets = {_subpackage(m) for m in _imports(path)} - {None, src}
        graph.setdefault(src, set()).update(targets)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle, as the path from a node back to itself (depth-first)."""
    found = []

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == path[0]:
                found.append(path + [nxt])
            elif nxt not in path and nxt > path[0]:  # each cycle once, from its smallest node
                walk(nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, [start])
    return found


def test_no_subpackage_imports_one_that_imports_it_back():
    graph = subpackage_graph()
    assert {"ortho", "optim", "distributed", "fast", "qkclip"} <= set(graph)
    assert _cycles(graph) == []


def test_the_core_imports_no_layer_built_on_it():
    graph = subpackage_graph()
    assert graph["ortho"] <= set(), graph["ortho"]
    assert graph["optim"] <= {"ortho"}, graph["optim"]
    for core in CORE:
        assert not graph[core] & set(LAYERS)


def test_the_checks_see_a_cycle_and_a_core_import():
    """Control: the parser finds a relative import inside a function and the checks reject the
    graph it would make."""
    graph = subpackage_graph()
    assert "optim" in graph["distributed"]  # distributed/engine.py: `from ..optim.buckets import ...`
    assert _cycles({**graph, "optim": graph["optim"] | {"distributed"}})
    assert "qkclip" in {_subpackage(m) for m in _imports(SRC / "models" / "gpt.py")}


def test_the_core_update_is_one_hop_from_optim():
    """``optim/__init__.py`` names the functional update, and it is short enough to read at once."""
    import inspect

    from muonclip.optim import functional

    assert muonclip.optim.muon_update is functional.muon_update is muonclip.muon_update
    lines = inspect.getsource(functional.muon_update).splitlines()
    assert len(lines) <= 60


class _Refusing:
    """An engine that fails the test if the core ever asks it for anything."""

    def __getattr__(self, name):
        raise AssertionError(f"a one-process step called the distributed engine's {name}")


def _step(**kw):
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(8, 12))
    b = torch.nn.Parameter(torch.randn(12))
    opt = muonclip.Muon([{"params": [W]}, {"params": [b], "algorithm": "adamw"}], lr=0.02, **kw)
    W.grad, b.grad = torch.randn_like(W), torch.randn_like(b)
    opt.step()
    return W


def test_one_process_never_enters_the_distributed_layer(monkeypatch):
    monkeypatch.setattr(engine_mod, "_ENGINES", [_Refusing()])
    for mode in ("raise", "mask"):
        assert torch.isfinite(_step(on_nonfinite=mode)).all()
    assert torch.isfinite(_step(process_group="local")).all()


def test_a_step_that_needs_the_distributed_layer_without_it_is_an_error(monkeypatch):
    """Never silently per shard: with no engine registered, a step over a process group raises
    before anything is updated."""
    monkeypatch.setattr(engine_mod, "_ENGINES", [])
    with pytest.raises(RuntimeError, match="import muonclip.distributed"):
        _step(process_group=object())
    assert engine_mod.engine_for([torch.zeros(2, 2)], None) is None  # nothing needed, nothing asked
