"""The layout of the package: what may import what, where the core's update is, and where family knowledge is.

Every import in ``src/muonclip`` (module level or inside a function, absolute or relative) is
read with ``ast`` (`import_graph`). The subpackages come from the file system, and each must
have its floor in `FLOORS`: a new one fails here until it is placed. A test fails on an import
from a floor to a higher one, on a cycle between subpackages, and on modules that import each
other (imports inside functions counted). Then, the core's extension point: one process never
enters the distributed layer, and a step that needs it without it is an error. Last, what the core knows
of model families comes from the family table alone (`muonclip.integrations.families`): the
core imports no framework and names none of the table's classes and attributes.
"""

from __future__ import annotations

import ast
import dataclasses

import pytest
import torch
from import_graph import SRC, components, cycles, imports, module_graph, subpackage, subpackage_graph, subpackages

import muonclip
import muonclip.integrations.families as family_table
from muonclip.optim import _stepping, multiprocess

GROUND, CORE, LAYER, APP = 0, 1, 2, 3
FLOORS = {
    "common": GROUND,  # DTensor geometry, Triton availability, the family registry: imports nothing of muonclip
    "ortho": CORE,
    "optim": CORE,
    "fast": LAYER,
    "distributed": LAYER,
    "attention": LAYER,
    "qkclip": LAYER,
    "integrations": LAYER,
    "models": LAYER,
    "app": APP,
}
"""Every subpackage's floor. A subpackage may import its own floor's and lower floors' (layers
import layers only where one is built on another: QK-Clip on attention's recorders)."""


def test_every_subpackage_has_a_floor():
    found = subpackages()
    assert found == set(FLOORS), (
        f"subpackages without a floor in FLOORS: {sorted(found - set(FLOORS))}; "
        f"floors of subpackages that do not exist: {sorted(set(FLOORS) - found)}"
    )


def test_no_subpackage_imports_a_higher_floor():
    graph = subpackage_graph()
    upward = {(a, b) for a, targets in graph.items() for b in targets if FLOORS[b] > FLOORS[a]}
    assert not upward, upward
    assert graph["common"] == set(), graph["common"]
    assert graph["ortho"] <= {"common"}, graph["ortho"]
    assert graph["optim"] <= {"common", "ortho"}, graph["optim"]


def test_no_cycle_between_subpackages():
    assert cycles(subpackage_graph()) == []


def test_no_modules_import_each_other():
    """No group of modules imports each other, counting every import: at module level and inside
    functions (an import inside a function hides a circle until it is called; it is still one)."""
    found = sorted(sorted(c) for c in components(module_graph(lazy=True)))
    assert found == [], f"modules that import each other (imports inside functions counted): {found}"


def test_the_circle_check_sees_a_circle_through_an_import_inside_a_function(tmp_path):
    """Control: a circle closed only by an import inside a function is one; ``from . import y``
    names the module y, not its package."""
    pkg = tmp_path / "muonclip" / "a"
    pkg.mkdir(parents=True)
    (tmp_path / "muonclip" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .x import f\n")
    (pkg / "x.py").write_text("def f():\n    from . import y\n    return y.g()\n")
    (pkg / "y.py").write_text("from .x import f\n\ndef g():\n    return f\n")
    src = tmp_path / "muonclip"
    assert imports(pkg / "x.py", src) == {"muonclip.a.y"}
    assert imports(pkg / "x.py", src, lazy=False) == set()
    assert components(module_graph(src, lazy=True)) == [{"muonclip.a.x", "muonclip.a.y"}]
    assert components(module_graph(src, lazy=False)) == []


def test_the_checks_see_a_cycle_and_an_upward_import():
    """Control: the parser finds relative imports, inside functions too, and the checks reject
    the graphs they would make."""
    graph = subpackage_graph()
    assert "optim" in graph["distributed"]  # distributed/_engine.py: `from ..optim._buckets import ...`
    assert cycles({**graph, "optim": graph["optim"] | {"distributed"}})
    assert "qkclip" in {subpackage(m) for m in imports(SRC / "models" / "_gpt.py")}
    assert "muonclip.models" in imports(SRC / "app" / "model.py")  # `from ..models import GPT` in a function
    assert components({"a": {"b"}, "b": {"a"}, "c": set()}) == [{"a", "b"}]


def test_the_core_update_is_one_hop_from_optim():
    """``optim/__init__.py`` names the functional update, and it is short enough to read at once;
    the step the class runs is next to it, and as short."""
    import inspect

    from muonclip.optim import functional

    assert muonclip.optim.muon_update is functional.muon_update is muonclip.muon_update
    for fn in (functional.muon_update, functional.muon_step):
        assert len(inspect.getsource(fn).splitlines()) <= 60, fn.__name__


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
    monkeypatch.setattr(multiprocess, "_ENGINES", [_Refusing()])
    for mode in ("raise", "mask"):
        assert torch.isfinite(_step(on_nonfinite=mode)).all()
    assert torch.isfinite(_step(process_group="local")).all()


def test_a_step_that_needs_the_distributed_layer_without_it_is_an_error(monkeypatch):
    """Never silently per shard: with no engine registered, a step over a process group raises
    before anything is updated."""
    monkeypatch.setattr(multiprocess, "_ENGINES", [])
    with pytest.raises(RuntimeError, match="import muonclip.distributed"):
        _step(process_group=object())
    assert _stepping.engine_for([torch.zeros(2, 2)], None) is None  # nothing needed, nothing asked


# ------------------------------------------------------------------------------------------------
# family knowledge: in the table, never in the core
# ------------------------------------------------------------------------------------------------

CORE = ("common", "ortho", "optim", "attention", "qkclip")
"""The subpackages that state no model family: they read the registered family table."""

FRAMEWORKS = ("transformers", "peft", "torchtitan")

LABELS = frozenset({"experts", "gate", "router", "query", "key", "value"})
"""Table names that are also plain words of the core's own vocabulary (report labels: "router",
"experts"; a fused MLP's maps "gate"/"up"; torch's SDPA argument names "query"/"key"/"value"):
allowed as such, never as an attribute the core reads."""


def table_names(obj: object) -> set[str]:
    """Every class and attribute name ``obj`` (the family table, or any of its records) holds;
    map labels (``order``) and adapter roles are muonclip's own words, not names."""
    if isinstance(obj, str):
        return {obj}
    if isinstance(obj, dict):
        return set().union(set(), *(table_names(k) | table_names(v) for k, v in obj.items()))
    if isinstance(obj, (tuple, list)):
        return set().union(set(), *map(table_names, obj))
    if dataclasses.is_dataclass(obj):
        out: set[str] = set()
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.name == "roles":
                value = tuple(part for part, _ in value)
            if f.name != "order":
                out |= table_names(value)
        return out
    return set()


def _own_names(trees: list[ast.Module]) -> set[str]:
    """Names the core defines itself (functions, classes, arguments, fields, attributes it sets): an
    attribute of that name may be the core's own (a layout's ``head_dim``)."""
    out: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.arg):
                out.add(node.arg)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out.add(node.target.id)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                out.update(t.attr for t in targets if isinstance(t, ast.Attribute))
    return out


def family_knowledge(tree: ast.Module, names: set[str], own: set[str]) -> list[str]:
    """Where ``tree`` imports a framework or names one of ``names``: an attribute it reads (``m.c_attn``,
    ``getattr(m, "c_attn")``) unless the core defines that name itself, or a string of its code
    (docstrings and pieces of f-strings aside; `LABELS` only as attribute names)."""
    skip: set[int] = set()
    reads: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):  # docstrings, and the docstrings of attributes
            skip.update(id(st.value) for st in body if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1 and \
                node.func.id in ("getattr", "hasattr", "setattr", "delattr"):
            reads.add(id(node.args[1]))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"line {node.lineno}: imports {m}" for m in modules if m.split(".")[0] in FRAMEWORKS]
        elif isinstance(node, ast.Attribute) and node.attr in names and node.attr not in own:
            found.append(f"line {node.lineno}: reads .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if node.value in names and (id(node) in reads or node.value not in LABELS):
                found.append(f"line {node.lineno}: names {node.value!r}")
    return found


def test_the_core_imports_no_framework_and_names_nothing_of_the_family_table():
    """Every class and attribute name of the family table (transformers', peft's, torch's fused
    projections, head counts, q/k norms, adapter names) is stated there only: the core reads it
    through the registry (`muonclip.common.families`, `muonclip.common.family_readers`)."""
    names = set().union(*(table_names(getattr(family_table, n)) for n in family_table.__all__))
    assert {"GPT2Attention", "Conv1D", "lora_A", "base_layer", "c_attn", "Qwen3Attention", "mp_num"} <= names
    files = sorted(p for d in CORE for p in (SRC / d).rglob("*.py"))
    trees = {p: ast.parse(p.read_text(encoding="utf-8")) for p in files}
    own = _own_names(list(trees.values()))
    found = {str(p.relative_to(SRC)): f for p, tree in trees.items() if (f := family_knowledge(tree, names, own))}
    assert not found, found


def test_the_family_check_sees_each_way_of_naming_a_family():
    """Control: an import, an attribute read, a getattr, a class name compared, a label read as an
    attribute are found; docstrings, f-string pieces, labels and the core's own names are not."""
    source = (
        '"""Mentions GPT2Attention and Conv1D in prose."""\n'
        "import transformers\n"
        "from peft.tuners import lora\n"
        "def f(m, head_dim):\n"
        "    w = m.c_attn.weight\n"
        "    g = getattr(m, 'router', None)\n"
        "    if type(m).__name__ == 'Conv1D': pass\n"
        "    p = getattr(m, f'{head_dim}_bias')\n"
        "    reason = 'router'\n"
        "    return m.head_dim\n"
    )
    found = family_knowledge(ast.parse(source), {"GPT2Attention", "Conv1D", "c_attn", "router", "_bias", "head_dim"},
                             {"head_dim"})
    assert found == ["line 2: imports transformers", "line 3: imports peft.tuners", "line 5: reads .c_attn",
                     "line 6: names 'router'", "line 7: names 'Conv1D'"], found


# ------------------------------------------------------------------------------------------------
# what is public: the rule, and the module map (docs/design.md, "Module map")
# ------------------------------------------------------------------------------------------------

DESIGN = (SRC.parents[1] / "docs" / "design").with_suffix(".md")
"""The spec, whose module map (docs/design.md, "Module map") these tests hold to the tree."""


def is_internal(rel: str) -> bool:
    """The rule (docs/design.md, "Module map"): a module whose file name begins with an underscore
    is internal, and so is every module of the command-line program (``app/``); a package's
    ``__init__`` is its package's surface."""
    name = rel.rsplit("/", 1)[-1]
    if name in ("__init__.py", "__main__.py"):
        return name == "__main__.py"
    return name.startswith("_") or rel.startswith("app/")


def declares_all(path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(isinstance(t, ast.Name) and t.id == "__all__"
               for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))


def tree_modules() -> dict[str, set[str]]:
    """Every module file of the package by folder (``"optim/"``: ``{"functional.py", ...}``), the
    packages' ``__init__.py`` aside."""
    out: dict[str, set[str]] = {}
    for p in SRC.rglob("*.py"):
        rel = p.relative_to(SRC)
        if p.name != "__init__.py" and len(rel.parts) > 1:
            out.setdefault("/".join(rel.parts[:-1]) + "/", set()).add(p.name)
    return out


def map_modules(text: str) -> dict[str, set[str]]:
    """The modules the module map (docs/design.md, "Module map") names, by folder: in the
    first code block after that heading, a word ending in ``/`` opens a folder and a line whose first word
    ends in ``.py`` names a module of the folder opened last."""
    section = text.split("\n## Module map", 1)[1]
    block = section.split("```", 2)[1]
    out: dict[str, set[str]] = {}
    folder = None
    for line in block.splitlines():
        words = line.split()
        if not words:
            continue
        if words[0].endswith(".py"):
            assert folder is not None, f"module map: {words[0]} before any folder"
            out[folder].add(words[0])
            continue
        opened = [w for w in words[:2] if w.endswith("/")]
        if opened and line[: line.index(opened[0])].strip() in ("", "ground", "core", "layers", "app"):
            folder = opened[0]
            out.setdefault(folder, set())
    return out


def test_the_module_map_names_every_module_and_no_other():
    """The module map (docs/design.md, "Module map") matches the tree: each folder's modules,
    no more, no fewer."""
    mapped, found = map_modules(DESIGN.read_text(encoding="utf-8")), tree_modules()
    missing = {f: sorted(m - mapped.get(f, set())) for f, m in found.items() if m - mapped.get(f, set())}
    extra = {f: sorted(m - found.get(f, set())) for f, m in mapped.items() if m - found.get(f, set())}
    assert not missing and not extra, (
        f'the module map (docs/design.md, "Module map") lacks {missing} and names {extra}, which are not in '
        "src/muonclip: "
        "add a line for each new module under its folder (one line: what it holds), remove the ones that went")


def test_the_paths_of_the_design_exist():
    """Every path of a module of ours the spec writes (``optim/functional.py``) exists."""
    import re

    text = DESIGN.read_text(encoding="utf-8")
    roots = {p.name for p in SRC.iterdir() if p.is_dir() and not p.name.startswith("__")}
    paths = set(re.findall(r"(?<![\w/.])((?:[a-z_]+/)+[A-Za-z_0-9]+\.py)\b", text))
    ours = {p for p in paths if p.split("/")[0] in roots}
    assert {"optim/functional.py", "qkclip/_rows.py"} <= ours
    gone = sorted(p for p in ours if not (SRC / p).exists())
    assert not gone, f"the spec names modules that do not exist: {gone}"


def test_all_is_declared_where_the_rule_puts_it():
    """A public module declares ``__all__`` (the names meant for users); an internal one (its name
    begins with an underscore, or it is the app's) declares none. Packages declare theirs."""
    wrong_public, wrong_internal = [], []
    for p in sorted(SRC.rglob("*.py")):
        rel = p.relative_to(SRC).as_posix()
        if p.name == "__main__.py" or rel.startswith("app/") and p.name == "__init__.py":
            continue
        has = declares_all(p)
        if is_internal(rel) and has:
            wrong_internal.append(rel)
        elif not is_internal(rel) and not has:
            wrong_public.append(rel)
    assert not wrong_internal, f"internal modules that declare __all__ (drop it): {wrong_internal}"
    assert not wrong_public, f"public modules without __all__ (list the names meant for users): {wrong_public}"


def test_the_rule_and_the_map_checks_see_what_they_must():
    """Control: the rule tells internal from public, and the map parser reads folders and modules."""
    assert is_internal("optim/_muon.py") and is_internal("app/train.py") and not is_internal("optim/fused.py")
    assert not is_internal("optim/__init__.py") and not is_internal("integrations/hf.py")
    text = "x\n## Module map\n\n```\ncore    optim/   the core\n          a.py   one\n" \
           "layers  app/report/   r\n          b.py   two\n```\n"
    assert map_modules(text) == {"optim/": {"a.py"}, "app/report/": {"b.py"}}
