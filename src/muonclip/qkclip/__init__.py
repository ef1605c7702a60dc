"""QK-Clip: head layouts, the clip, layer discovery and the `MuonClip` optimizer."""

from .clip import all_reduce_max_, apply_qk_clip, compute_gamma
from .discovery import discover_layers
from .layouts import GQA_POLICIES, AttentionLayer, GQALayout, Layout, MHALayout, MLALayout, Rows
from .muonclip import MuonClip

__all__ = [
    "GQA_POLICIES",
    "AttentionLayer",
    "GQALayout",
    "Layout",
    "MHALayout",
    "MLALayout",
    "MuonClip",
    "Rows",
    "all_reduce_max_",
    "apply_qk_clip",
    "compute_gamma",
    "discover_layers",
]
