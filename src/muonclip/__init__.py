"""muonclip: the Muon optimizer and MuonClip (Muon + QK-Clip) for PyTorch.

Public API (design.md section 2):

* `orthogonalize` — Newton–Schulz quintic, Polar Express and exact SVD polar factor.
* `Muon` — Muon for hidden matrices plus an AdamW branch in one optimizer.
* `param_groups` — routes a model's parameters to Muon or AdamW.
"""

from .attention import scaled_dot_product_attention
from .optim import Muon, NonFiniteGradError, ParamGroups, param_groups
from .ortho import orthogonalize
from .qkclip import MuonClip

__version__ = "0.1.0"

__all__ = [
    "Muon", "MuonClip", "NonFiniteGradError", "ParamGroups", "orthogonalize", "param_groups",
    "scaled_dot_product_attention", "__version__",
]
