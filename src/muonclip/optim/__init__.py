"""The optimizer, the core layer above `muonclip.ortho`.

Public modules:

* `functional` — the Muon update in one place: its phases and `muon_step`, their one
  composition (what `Muon.step` runs, in one process and over several; `muon_update` is its
  call for one weight).
* `workspace`, `multiprocess` — the extension points that `muonclip.fast` (where buckets live)
  and `muonclip.distributed` (the exchanges of a step over several processes) plug into.
* `fused` — how a fused weight is cut into its maps (`weight_splits`); `flat` — flattened
  parameters, refused.

Internal (their names are reached through this package):

* `_muon` — `Muon`, the thin optimizer shell over it (its state, with the AdamW branch of `_adamw`).
* `_validation` — what `Muon` accepts (its arguments, param groups and loaded state, each step's
  numbers and gradients: raise or skip on a non-finite one); `_nonfinite_mask` —
  ``on_nonfinite="mask"``, the skip without a host sync; `_unrouted` — parameters nobody routed.
* `_state_dicts`, `_state_validation`, `_torch_state_dicts` — `Muon`'s state dicts, what a loaded
  one must hold, and their conversions to and from torch.optim's.
* `_quantized` — the 8-bit momentum's blocks.
* `_matrices`, `_buckets`, `_scale` — how a weight is seen as matrices (`MatrixSpec`), the step's
  structure (units of work, same-shape blocks batched into one orthogonalisation), the update
  scale rules.
* `_routing` — `param_groups`: which parameter gets Muon or AdamW.
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
