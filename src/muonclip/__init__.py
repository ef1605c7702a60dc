"""muonclip: the Muon optimizer and MuonClip (Muon + QK-Clip) for PyTorch.

Every export (the algorithms and where each piece lives: docs/design.md, "Module map"):

* `Muon` — Muon for hidden matrices plus an AdamW branch in one optimizer; takes
  torch.optim.Muon's arguments.
* `MuonClip` — `Muon` + QK-Clip (Kimi K2) in one ``step()``, for a model whose attention
  layers it finds.
* `param_groups` — routes a model's parameters to Muon or AdamW, with fused weights split into
  their maps; returns a `ParamGroups` (a list of param groups with a ``.report()``).
* `ParamGroups` — that list.
* `muon_update` — the Muon update of one weight, as a function: the step body `Muon.step` runs, on one weight.
* `orthogonalize` — the polar factor by Newton–Schulz (``"ns5"``), Polar Express, Gram
  Newton–Schulz or SVD.
* `scaled_dot_product_attention` — a drop-in for ``F.scaled_dot_product_attention`` that also
  records per-head max logits for QK-Clip.
* `NonFiniteGradError` — raised by a step that meets a NaN or inf gradient.
* ``__version__``.

Importing the package also registers its layers with the core: `muonclip.distributed` (steps
over several processes), `muonclip.fast` (the opt-in fast paths and the CPU default workspace)
and `muonclip.integrations` (Hugging Face models' attention layers for `MuonClip`).
"""

from . import distributed as _distributed  # noqa: F401  (registers the distributed engine)
from . import fast as _fast  # noqa: F401  (registers workspaces and methods)
from . import integrations as _integrations  # noqa: F401  (registers the transformers layer discovery)
from .attention import scaled_dot_product_attention
from .optim import Muon, NonFiniteGradError, ParamGroups, muon_update, param_groups
from .ortho import orthogonalize
from .qkclip import MuonClip

__version__ = "0.1.0"

__all__ = [
    "Muon", "MuonClip", "NonFiniteGradError", "ParamGroups", "muon_update", "orthogonalize", "param_groups",
    "scaled_dot_product_attention", "__version__",
]
