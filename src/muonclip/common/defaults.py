"""Every default of the optimizers and of the functions they are built from, in one place.

`muonclip.Muon`, `muonclip.MuonClip`, `muonclip.muon_update`, `muonclip.orthogonalize` (and
the orthogonalisers under it), the torchtitan container's config and the command-line app
read their defaults from here, so a function and a class never disagree: the same call with
the same defaults is the same update on every machine (``tests/test_defaults.py`` compares
every public signature with these values).

The compute dtype's default, `ORTH_DTYPE` = ``"auto"``, is a rule rather than a dtype: bfloat16
where the device multiplies it natively, float32 elsewhere, resolved per device by
`muonclip.ortho` (docs/design.md, "Compute dtype").
"""

from __future__ import annotations

LR = 1e-3
"""Learning rate of `muonclip.Muon` and `muonclip.MuonClip`."""

WEIGHT_DECAY = 0.1
"""Decoupled weight decay, multiplied by the learning rate."""

MOMENTUM = 0.95
"""Muon's momentum coefficient mu."""

NESTEROV = True
"""Orthogonalise ``G + mu M`` (Nesterov) rather than ``M``."""

ADJUST_LR_FN = "match_rms_adamw"
"""The update scale rule (`muonclip.optim.SCALES`): 0.2 sqrt(max(A, B)), AdamW's update RMS."""

METHOD = "ns5"
"""The orthogonalisation method: Keller Jordan's quintic Newton–Schulz."""

AUTO = "auto"
"""The compute dtype rule: bfloat16 where the device multiplies it natively, else float32."""

ORTH_DTYPE = AUTO
"""The orthogonalisation's compute dtype (`AUTO`)."""

NS_STEPS: int | None = None
"""Iterations of the method (None: the method's own, 5 for the iterative ones)."""

NS_COEFFICIENTS: tuple[float, float, float] | None = None
"""The quintic's (a, b, c) (None: the method's own, Keller Jordan's for ``"ns5"``)."""

EPS = 1e-7
"""Added to each matrix's Frobenius norm before the orthogonalisation (a zero matrix gives zeros)."""

BETAS = (0.9, 0.95)
"""The AdamW branch's moment coefficients."""

ADAMW_EPS = 1e-8
"""The AdamW branch's epsilon."""

NORMUON_BETA2 = 0.95
"""NorMuon's EMA coefficient of each row's second moment."""

TAU = 100.0
"""QK-Clip's threshold on the max logit (Kimi K2's)."""

__all__ = ["ADAMW_EPS", "ADJUST_LR_FN", "AUTO", "BETAS", "EPS", "LR", "METHOD", "MOMENTUM", "NESTEROV",
           "NORMUON_BETA2", "NS_COEFFICIENTS", "NS_STEPS", "ORTH_DTYPE", "TAU", "WEIGHT_DECAY"]
