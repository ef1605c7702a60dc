"""The optimizer: `Muon` (with its AdamW branch) and `param_groups` routing."""

from .muon import Muon
from .nonfinite import NonFiniteGradError
from .routing import ParamGroups, Route, param_groups
from .scale import SCALES, update_scale

__all__ = ["Muon", "NonFiniteGradError", "ParamGroups", "Route", "param_groups", "SCALES", "update_scale"]
