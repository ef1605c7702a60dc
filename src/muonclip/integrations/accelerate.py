"""accelerate: its optimizer wrapper passes a muonclip optimizer's attributes on.

``Accelerator.prepare`` (and the Hugging Face Trainer through it) returns the optimizer inside
``accelerate.optimizer.AcceleratedOptimizer``, which passes on ``step``, ``zero_grad``, the state
dicts, ``param_groups`` and ``state`` only: ``optimizer.clip_stats()`` or ``optimizer.tau`` would
be AttributeErrors. For a `muonclip.Muon` or `muonclip.MuonClip` inside it, `pass_attributes_on`
does what Lightning's ``LightningOptimizer`` does to itself: it makes the wrapper an instance of
a class built from the wrapper's class and the optimizer's (`combined_class`), so the wrapper's
own methods come first (``step`` with accelerate's gradient-accumulation and mixed-precision
logic, ``zero_grad``, the state dicts), then the optimizer class's, and what the wrapper lacks is
read from the optimizer (`muonclip.optim._wrappers`): ``clip_stats()``, ``tau`` (setting it sets
the optimizer's), ``last_max_logits``, ``layers``, ``steps_taken`` ...; ``isinstance(wrapper,
MuonClip)`` holds. A wrapper around any other optimizer is left as accelerate made it.

`install` wraps ``AcceleratedOptimizer.__init__`` once, to call `pass_attributes_on` on every
wrapper built after it. `muonclip.integrations` installs it when a `muonclip.Muon` is built in a
process where accelerate is already imported (``import muonclip`` never imports accelerate);
an optimizer built before accelerate is first imported is wrapped as accelerate makes it, and
`muonclip.integrations.unwrap_optimizer` still finds it.
"""

from __future__ import annotations

import functools

try:
    from accelerate.optimizer import AcceleratedOptimizer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("muonclip.integrations.accelerate needs accelerate: pip install 'muonclip[hf]'") from e

from ..optim import Muon

INSTALLED_ATTR = "muonclip_passes_attributes_on"
"""Attribute of the ``AcceleratedOptimizer.__init__`` that `install` put in place."""


@functools.cache
def combined_class(wrapper_class: type, optimizer_class: type) -> type:
    """The class of a wrapper of ``wrapper_class`` around an optimizer of ``optimizer_class``: the
    wrapper's class first, then the optimizer's (one class per pair)."""
    name = (f"Accelerated{optimizer_class.__name__}" if wrapper_class is AcceleratedOptimizer
            else f"{wrapper_class.__name__}{optimizer_class.__name__}")
    return type(name, (wrapper_class, optimizer_class), {})


def pass_attributes_on(wrapper: AcceleratedOptimizer) -> None:
    """Make ``wrapper``, an ``AcceleratedOptimizer`` around a muonclip optimizer, pass that
    optimizer's attributes on (module docstring); any other wrapper is left alone."""
    inner = wrapper.__dict__.get("optimizer")
    if isinstance(inner, Muon) and not isinstance(wrapper, Muon):
        wrapper.__class__ = combined_class(type(wrapper), type(inner))


def install() -> None:
    """Make every ``AcceleratedOptimizer`` built from now on pass a muonclip optimizer's attributes
    on (`pass_attributes_on`); installing again is a no-op."""
    init = AcceleratedOptimizer.__init__
    if getattr(init, INSTALLED_ATTR, False):
        return

    @functools.wraps(init)
    def __init__(self: AcceleratedOptimizer, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        pass_attributes_on(self)

    setattr(__init__, INSTALLED_ATTR, True)
    AcceleratedOptimizer.__init__ = __init__


__all__ = ["combined_class", "install", "pass_attributes_on"]
