"""Update scaling rules: the factor applied to an orthogonalised update of an A x B matrix.

Named by formula (design.md 1.1):

* ``"rms"``   = 0.2 * sqrt(max(A, B))  — Moonlight / Kimi K2; update RMS ~ 0.2 like AdamW's, so
  AdamW's learning rate and weight decay carry over (torch.optim.Muon: ``match_rms_adamw``).
* ``"shape"`` = sqrt(max(1, A / B))    — Keller Jordan's original (torch: ``original``).
* ``"none"``  = 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable

SCALES: dict[str, Callable[[int, int], float]] = {
    "rms": lambda A, B: 0.2 * math.sqrt(max(A, B)),
    "shape": lambda A, B: math.sqrt(max(1.0, A / B)),
    "none": lambda A, B: 1.0,
}

# torch.optim.Muon's adjust_lr_fn values and the scale each one means.
TORCH_ADJUST_LR_FN: dict[str | None, str] = {
    None: "shape",
    "original": "shape",
    "match_rms_adamw": "rms",
}


def update_scale(name: str, A: int, B: int) -> float:
    """Return the scale of rule ``name`` for an ``A x B`` matrix (A = output rows)."""
    if name not in SCALES:
        raise ValueError(f"unknown update_scale {name!r}; choose one of {sorted(SCALES)}")
    return SCALES[name](A, B)
