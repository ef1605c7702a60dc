"""Framework wrappers made instances of a muonclip optimizer's class, and what runs when one is built.

Lightning's ``LightningOptimizer`` makes itself an instance of a class built from its own and the
optimizer's (so that ``isinstance`` checks pass), and holds the optimizer as ``_optimizer``;
`muonclip.integrations.accelerate` does the same for accelerate's ``AcceleratedOptimizer`` around
a muonclip optimizer (which holds it as ``optimizer``). Such a wrapper has the optimizer class's
methods and none of the optimizer's attributes, so `muonclip.Muon` reads an attribute it lacks
from the optimizer it wraps (`wrapped_optimizer`): ``clip_stats()``, ``tau``, ``steps_taken``,
``last_max_logits`` ... are the optimizer's, and its setters of the optimizer-wide values
(``steps_taken``, ``steps_skipped``, `muonclip.MuonClip`'s ``tau``) set the optimizer's.

`register_build_hook`: a function the layers above the core give, called each time a
`muonclip.Muon` is built (`muonclip.integrations` gives the one that makes accelerate's wrapper
pass the attributes on once accelerate is imported), so the core imports no framework.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

WRAPPED_ATTRS = ("_optimizer", "optimizer")
"""Where a wrapper keeps the optimizer it wraps: Lightning's ``LightningOptimizer``, accelerate's
``AcceleratedOptimizer``."""

_BUILD_HOOKS: list[Callable[[], None]] = []


def wrapped_optimizer(obj: Any, cls: type) -> Any | None:
    """The ``cls`` instance that ``obj`` wraps when ``obj`` is a wrapper made an instance of ``cls``
    (module docstring), else None. Reads ``obj.__dict__`` only (no attribute lookup, so it never
    recurses into ``__getattr__``)."""
    held = getattr(obj, "__dict__", {})
    for attr in WRAPPED_ATTRS:
        inner = held.get(attr)
        if isinstance(inner, cls) and inner is not obj:
            return inner
    return None


def register_build_hook(hook: Callable[[], None]) -> None:
    """Call ``hook()`` each time a `muonclip.Muon` (or `muonclip.MuonClip`) is built (registering
    it again is a no-op)."""
    if hook not in _BUILD_HOOKS:
        _BUILD_HOOKS.append(hook)


def run_build_hooks() -> None:
    """Run every registered build hook, in order (`muonclip.Muon.__init__` does)."""
    for hook in _BUILD_HOOKS:
        hook()
