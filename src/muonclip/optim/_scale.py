"""Update scaling rules: the factor applied to an orthogonalised update of an A x B matrix.

Named as torch.optim.Muon's ``adjust_lr_fn`` names them (docs/design.md, "Muon"):

* ``"match_rms_adamw"`` = 0.2 * sqrt(max(A, B)) — Moonlight / Kimi K2; update RMS ~ 0.2 like
  AdamW's, so AdamW's learning rate and weight decay carry over. `muonclip.Muon`'s default.
* ``"original"`` = sqrt(max(1, A / B)) — Keller Jordan's original; ``None`` means this too
  (torch.optim.Muon's default).
* ``"unscaled"`` = 1 — the orthogonalised matrix as it is (ours; for experiments).
"""

from __future__ import annotations

import math
from collections.abc import Callable

SCALES: dict[str, Callable[[int, int], float]] = {
    "match_rms_adamw": lambda A, B: 0.2 * math.sqrt(max(A, B)),
    "original": lambda A, B: math.sqrt(max(1.0, A / B)),
    "unscaled": lambda A, B: 1.0,
}


def scale_name(adjust_lr_fn: str | None) -> str:
    """The rule ``adjust_lr_fn`` names (None: ``"original"``, torch's meaning); ValueError if unknown."""
    name = "original" if adjust_lr_fn is None else adjust_lr_fn
    if name not in SCALES:
        raise ValueError(f"adjust_lr_fn must be None or one of {sorted(SCALES)}, got {adjust_lr_fn!r}")
    return name


def update_scale(adjust_lr_fn: str | None, A: int, B: int) -> float:
    """Return the scale of rule ``adjust_lr_fn`` for an ``A x B`` matrix (A = output rows)."""
    return SCALES[scale_name(adjust_lr_fn)](A, B)
