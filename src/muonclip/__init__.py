"""muonclip: the Muon optimizer and MuonClip (Muon + QK-Clip) for PyTorch.

Public API (design.md section 2):

* `orthogonalize` — Newton–Schulz quintic, Polar Express and exact SVD polar factor.
* `Muon` — Muon for hidden matrices plus an AdamW branch in one optimizer.
* `param_groups` — routes a model's parameters to Muon or AdamW.
"""

from .optim import Muon, NonFiniteGradError, ParamGroups, param_groups
from .ortho import orthogonalize

__version__ = "0.1.0"

__all__ = ["Muon", "NonFiniteGradError", "ParamGroups", "orthogonalize", "param_groups", "__version__"]
