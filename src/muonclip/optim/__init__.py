"""The optimizer, the core layer above `muonclip.ortho`.

* `functional` — the Muon update as functions: `muon_update` and its phases.
* `muon` — `Muon`, the thin optimizer shell over them (with the AdamW branch of `adamw`).
* `buckets` — same-shape matrices orthogonalised in one call.
* `matrices`, `scale` — how a weight is seen as matrices; the update scale rules.
* `routing`, `fused` — `param_groups`: which parameter gets Muon or AdamW, and how a fused
  weight is cut into its maps.
* `nonfinite`, `masked` — non-finite gradients: raise, skip, or mask without a host sync.
* `backend`, `engine` — the extension points that `muonclip.fast` (where buckets live) and
  `muonclip.distributed` (steps over several processes) plug into.
"""

from .adamw import adamw_update
from .functional import muon_update
from .muon import Muon
from .nonfinite import NonFiniteGradError
from .routing import ParamGroups, Route, param_groups
from .scale import SCALES, update_scale

__all__ = [
    "Muon", "NonFiniteGradError", "ParamGroups", "Route", "SCALES", "adamw_update", "muon_update", "param_groups",
    "update_scale",
]
