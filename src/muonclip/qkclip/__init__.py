"""QK-Clip: head layouts, the clip, layer discovery, the checks that it acts, and the `MuonClip` optimizer.

Hugging Face transformers models are found through `muonclip.integrations.hf` (registered with
`register_discoverer` by `muonclip.integrations`).
"""

from .check import QKClipIneffectiveError, QKClipIneffectiveWarning
from .clip import all_reduce_max_, apply_qk_clip, compute_gamma
from .discovery import discover_layers, register_discoverer
from .layouts import GQA_POLICIES, AttentionLayer, GQALayout, Layout, MHALayout, MLALayout
from .muonclip import MuonClip
from .rows import Magnitudes, Rows, StridedRows

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
