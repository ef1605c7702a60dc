"""QK-Clip: head layouts, the clip, layer discovery, the checks that it acts, and the `MuonClip` optimizer.

Hugging Face transformers models are found through `muonclip.integrations.hf` (registered with
`register_discoverer` by `muonclip.integrations`).

Public modules: `binding` (the parameters MuonClip follows), `check` (that the clip acted),
`clip_targets` (what it may write), `qknorm` (norms that would undo it), `tensor_parallel` (a TP
rank's heads), `step_metrics` (what the logging callbacks report). Internal, their names exported
here: `_layouts`, `_rows`, `_discovery`, `_muonclip` (the optimizer and the clip's path).
"""

from ._discovery import discover_layers, register_discoverer
from ._layouts import GQA_POLICIES, AttentionLayer, GQALayout, Layout, MHALayout, MLALayout
from ._muonclip import MuonClip, all_reduce_max_, apply_qk_clip, compute_gamma
from ._rows import Magnitudes, Rows, StridedRows
from .check import QKClipIneffectiveError, QKClipIneffectiveWarning

__all__ = [
    "GQA_POLICIES",
    "AttentionLayer",
    "GQALayout",
    "Layout",
    "MHALayout",
    "MLALayout",
    "Magnitudes",
    "MuonClip",
    "QKClipIneffectiveError",
    "QKClipIneffectiveWarning",
    "Rows",
    "StridedRows",
    "all_reduce_max_",
    "apply_qk_clip",
    "compute_gamma",
    "discover_layers",
    "register_discoverer",
]
