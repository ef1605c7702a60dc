"""The optimizer, the core layer above `muonclip.ortho`.

* `functional` — the Muon update as functions: its phases, `muon_update` (one matrix) and
  `muon_step` (what `Muon.step` runs: the phases over same-shape buckets).
* `muon` — `Muon`, the thin optimizer shell over them (with the AdamW branch of `adamw`).
* `validation` — what `Muon` accepts (its arguments, param groups and loaded state).
* `state_dicts` — `Muon`'s state dicts, and their conversions to and from torch.optim's.
* `weight_state`, `quantized` — a Muon weight's state (float32 or 8-bit momentum, NorMuon's
  second moment) and the 8-bit momentum's blocks.
* `matrices`, `buckets`, `scale` — how a weight is seen as matrices (`MatrixSpec`), same-shape
  blocks batched into one orthogonalisation, the update scale rules.
* `routing`, `fused` — `param_groups`: which parameter gets Muon or AdamW, and how a fused
  weight is cut into its maps.
* `nonfinite`, `masked` — non-finite gradients: raise, skip, or mask without a host sync.
* `backend`, `distribution` — the extension points that `muonclip.fast` (where buckets live)
  and `muonclip.distributed` (steps over several processes) plug into.
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
