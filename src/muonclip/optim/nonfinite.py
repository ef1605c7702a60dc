"""Non-finite gradients: none may reach a weight or an optimizer buffer.

Three policies (``Muon(on_nonfinite=...)``):

* ``"raise"`` (default) and ``"skip"`` look at every gradient before the step
  (`finite_per_tensor`, then `nonfinite_indices`: one host sync per step, the answer decides a
  Python branch). ``raise`` names the bad parameters; ``skip`` returns without touching
  anything.
* ``"mask"`` decides on the device, with no host sync: the step runs on zeroed gradients and is
  undone where the flag is set (`muonclip.optim.masked.MaskedStep`).

Under FSDP2 each rank sees its own shards: the flags are computed on the local shards and the
distributed layer AND-s them over the ranks (`muonclip.optim.distribution.Engine.all_finite`).
"""

from __future__ import annotations

import torch
from torch import Tensor

ON_NONFINITE = ("raise", "skip", "mask")

GRAD_LIMIT = 2.0**100
"""The largest gradient entry a step accepts; a larger one counts as non-finite. Muon's float32
momentum ``M = mu M + G`` and its input ``G + mu M`` stay below ``|G|_max / (1 - mu)``, which
must fit float32 (largest value about ``2^128``): every ``mu`` below ``1 - 2^-27`` does with
this limit, while a gradient of 3e38 (or a steady 2e37 for 36 steps at ``mu`` = 0.95) would
overflow to inf and end as NaN weights. No gradient of a training run that has not diverged
comes near ``2^100`` (about 1.3e30)."""


class NonFiniteGradError(FloatingPointError):
    """A gradient holds NaN or inf (or an entry beyond `GRAD_LIMIT`); the step was not applied to any
    parameter."""


def finite_per_tensor(grads: list[Tensor]) -> Tensor:
    """A bool vector on ``grads[0].device`` (CPU for none): True where that gradient is all
    finite and at most `GRAD_LIMIT` in magnitude. No host sync.

    Exact for every finite input (no overflow): max |g| on CUDA (one fused ``_foreach_norm``
    launch), ``aminmax`` elsewhere (a plain reduction: torch's CPU ``_foreach_norm(ord=inf)`` is
    the slower one there). Both propagate NaN and inf.
    """
    if not grads:
        return torch.ones(0, dtype=torch.bool)
    device = grads[0].device

    def on_device(t: Tensor) -> Tensor:
        t = t.float()
        return t if t.device == device else t.to(device, non_blocking=True)

    if device.type == "cuda":
        stats = torch._foreach_norm(grads, ord=float("inf"))  # max |g|: inf for an inf, NaN for a NaN
        return torch.stack([on_device(s) for s in stats]) <= GRAD_LIMIT  # False for NaN and inf
    # (min, max): non-finite iff g is; an empty tensor is finite. One stack for all of them.
    ends = [torch.aminmax(g) if g.numel() else (g.new_zeros(()), g.new_zeros(())) for g in grads]
    both = torch.stack([on_device(e[0]) for e in ends] + [on_device(e[1]) for e in ends])
    return (both.abs() <= GRAD_LIMIT).view(2, len(grads)).all(dim=0)  # False for NaN and inf


def nonfinite_indices(finite: Tensor) -> list[int]:
    """Indices where ``finite`` (from `finite_per_tensor`) is False: one host sync for all."""
    if finite.numel() == 0 or bool(finite.all()):
        return []
    return [i for i, ok in enumerate(finite.tolist()) if not ok]


__all__ = ["GRAD_LIMIT", "ON_NONFINITE", "NonFiniteGradError", "finite_per_tensor", "nonfinite_indices"]
