"""Guard against non-finite gradients: none may reach a weight or an optimizer buffer."""

from __future__ import annotations

import torch
from torch import Tensor

ON_NONFINITE = ("raise", "skip")


class NonFiniteGradError(FloatingPointError):
    """A gradient holds NaN or inf; the step was not applied to any parameter."""


def nonfinite_indices(grads: list[Tensor]) -> list[int]:
    """Indices of the gradients that hold a NaN or an inf (one host sync for all of them)."""
    if not grads:
        return []
    # max |g| is inf for an inf and NaN for a NaN, and never overflows for finite input.
    norms = torch._foreach_norm(grads, ord=float("inf"))
    finite = torch.stack([n.float().to(norms[0].device) for n in norms]).isfinite()
    if bool(finite.all()):
        return []
    return [i for i, ok in enumerate(finite.tolist()) if not ok]
