"""QK-Clip: head layouts, the clip, layer discovery, the checks that it acts, and the `MuonClip` optimizer.

Hugging Face transformers models are found through `muonclip.integrations.hf` (registered with
`register_discoverer` by `muonclip.integrations`).
"""

from ._clip import all_reduce_max_, apply_qk_clip, compute_gamma
from ._discovery import discover_layers, register_discoverer
from ._layouts import GQA_POLICIES, AttentionLayer, GQALayout, Layout, MHALayout, MLALayout
from ._muonclip import MuonClip
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
