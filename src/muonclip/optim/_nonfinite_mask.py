"""``on_nonfinite="mask"``: a step that is undone on the device where a gradient was non-finite.

A wrapper around the unchanged step, with no host sync (for GPUs: the step never waits for the
device, e.g. under CUDA graphs or overlapped launches)::

    guard = MaskedStep(params, states, found)   # zero the gradients where found; snapshot
    ...the normal step...                       # the core update, untouched
    guard.restore()                             # where found, put every tensor back

``found`` is a 0-D bool device tensor (any gradient non-finite). Every gradient is zeroed where
it is set (``masked_fill_``), so the step computes on finite numbers only and state created
during it (e.g. a first momentum buffer) holds zeros, its fresh value. Every parameter and
every tensor already in its state is copied before the step and set to
``where(found, copy, new)`` after it: bit-exact either way, so a finite step is exactly the
default mode's and a masked one leaves everything as it was. The copies are kept between steps
in the caller's ``cache`` (fresh multi-MB copies would be page-faulted in every step on CPU).

Side effects on a masked step: the gradients are left zeroed; Python-side counters (e.g.
AdamW's bias-correction step number) still advance. Its cost, one copy and one select of the
parameters and the optimizer state per step, is measured by ``benchmarks/bench_step.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor


class MaskedStep:
    """Snapshot before a step; `restore` undoes it where ``found`` (see module docstring).

    Args:
        params: the parameters with a gradient in this step.
        states: their optimizer-state dicts (tensor values are protected; others ignored).
        found: 0-D bool tensor, True where the step must leave everything as it was.
        local: maps a tensor to the part this process holds (default: itself; for DTensors the
            distribution layer's ``local``, so nothing is communicated).
        cache: a list the caller keeps between steps; the copies live there and are reused while
            shapes, dtypes and devices match (default None: fresh copies every step).
    """

    def __init__(self, params: list[Tensor], states: Iterable[Mapping[str, Any]], found: Tensor,
                 local: Callable[[Tensor], Tensor] = lambda t: t, cache: list[Tensor] | None = None) -> None:
        self.found = found
        self._flags: dict[torch.device, Tensor] = {}
        for p in params:
            if p.grad is not None:
                g = local(p.grad)
                g.masked_fill_(self._flag_on(g.device), 0.0)
        protected = [local(p.detach()) for p in params]
        protected += [local(v) for s in states for v in s.values() if isinstance(v, Tensor)]
        if cache is not None and _same_geometry(cache, protected):
            copies = cache
        else:
            copies = [torch.empty_like(t) for t in protected]
            if cache is not None:
                cache[:] = copies
        for t, c in zip(protected, copies):
            c.copy_(t)
        self._tensors, self._copies = protected, copies

    def _flag_on(self, device: torch.device) -> Tensor:
        if device not in self._flags:
            self._flags[device] = self.found.to(device, non_blocking=True)
        return self._flags[device]

    @torch.no_grad()
    def restore(self) -> None:
        """Put every protected tensor back where ``found`` is set (no host sync)."""
        for t, saved in zip(self._tensors, self._copies):
            torch.where(self._flag_on(t.device), saved, t, out=t)
        self._copies = []


def _same_geometry(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and x.device == y.device and x.stride() == y.stride()
        for x, y in zip(a, b)
    )
