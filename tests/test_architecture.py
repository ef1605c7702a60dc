"""The layout of the package: what may import what, and where the core's update is.

Every import in ``src/muonclip`` (module level or inside a function, absolute or relative) is
read with ``ast`` (`import_graph`). The subpackages come from the file system, and each must
have its floor in `FLOORS`: a new one fails here until it is placed. A test fails on an import
from a floor to a higher one, on a cycle between subpackages, and on modules that import each
other when they load. Then, the core's extension point: one process never enters the
distributed layer, and a step that needs it without it is an error.
"""

from __future__ import annotations

import pytest
import torch
from import_graph import SRC, components, cycles, imports, module_graph, subpackage, subpackage_graph, subpackages

import muonclip
from muonclip.optim import distribution

GROUND, CORE, LAYER, APP = 0, 1, 2, 3
FLOORS = {
    "common": GROUND,  # DTensor geometry, Triton availability: imports nothing of muonclip
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


def test_no_modules_import_each_other_when_they_load():
    """Module level: no group of modules imports each other through imports that run when a
    module loads (an import inside a function runs when it is called)."""
    assert components(module_graph(lazy=False)) == []


def test_the_checks_see_a_cycle_and_an_upward_import():
    """Control: the parser finds relative imports, inside functions too, and the checks reject
    the graphs they would make."""
    graph = subpackage_graph()
    assert "optim" in graph["distributed"]  # distributed/engine.py: `from ..optim.buckets import ...`
    assert cycles({**graph, "optim": graph["optim"] | {"distributed"}})
    assert "qkclip" in {subpackage(m) for m in imports(SRC / "models" / "gpt.py")}
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
    monkeypatch.setattr(distribution, "_ENGINES", [_Refusing()])
    for mode in ("raise", "mask"):
        assert torch.isfinite(_step(on_nonfinite=mode)).all()
    assert torch.isfinite(_step(process_group="local")).all()


def test_a_step_that_needs_the_distributed_layer_without_it_is_an_error(monkeypatch):
    """Never silently per shard: with no engine registered, a step over a process group raises
    before anything is updated."""
    monkeypatch.setattr(distribution, "_ENGINES", [])
    with pytest.raises(RuntimeError, match="import muonclip.distributed"):
        _step(process_group=object())
    assert distribution.engine_for([torch.zeros(2, 2)], None) is None  # nothing needed, nothing asked
