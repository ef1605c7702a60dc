"""The optimizer, the core layer above `muonclip.ortho`.

* `functional` — the Muon update in one place: its phases and `muon_step`, their one
  composition (what `Muon.step` runs, in one process and over several; `muon_update` is its
  call for one weight).
* `muon` — `Muon`, the thin optimizer shell over it (its state, with the AdamW branch of `adamw`).
* `validation` — what `Muon` accepts (its arguments, param groups and loaded state, each step's
  numbers and gradients: raise or skip on a non-finite one); `masked` — ``on_nonfinite="mask"``,
  the skip without a host sync.
* `state_dicts` — `Muon`'s state dicts, and their conversions to and from torch.optim's.
* `quantized` — the 8-bit momentum's blocks.
* `matrices`, `buckets`, `scale` — how a weight is seen as matrices (`MatrixSpec`), the step's
  structure (units of work, same-shape blocks batched into one orthogonalisation), the update
  scale rules.
* `routing`, `fused` — `param_groups`: which parameter gets Muon or AdamW, and how a fused
  weight is cut into its maps.
* `workspace`, `distribution` — the extension points that `muonclip.fast` (where buckets live)
  and `muonclip.distributed` (the exchanges of a step over several processes) plug into.
"""

from ._adamw import adamw_update
from ._muon import Muon
from ._routing import ParamGroups, Route, param_groups
from ._scale import SCALES, update_scale
from ._validation import NonFiniteGradError
from .functional import muon_update

__all__ = [
    "Muon", "NonFiniteGradError", "ParamGroups", "Route", "SCALES", "adamw_update", "muon_update", "param_groups",
    "update_scale",
]
