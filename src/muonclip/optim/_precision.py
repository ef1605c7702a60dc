"""What the optimizer says about its compute dtype: ``orth_dtype`` resolved per device, and why.

The rule itself (``"auto"``: bfloat16 where the device multiplies it natively, float32
elsewhere) is the orthogonaliser's (`muonclip.ortho.resolve_orth_dtype`, `muonclip.ortho._precision`),
the same for `muonclip.orthogonalize`, `muonclip.muon_update` and `muonclip.Muon`. The step
resolves it per device of the parameters when it builds its buckets, so in one optimizer a model
on a GPU and parameters offloaded to the CPU each get their own; a checkpoint saves ``"auto"``
itself, and resumed on another kind of machine resolves again there. This module names the
choice for the optimizer's repr, `muonclip.ParamGroups.report` and the app's report.
"""

from __future__ import annotations

from typing import Any

import torch

from ..common._hardware import native_bf16
from ..common.defaults import AUTO
from ..ortho import METHODS, resolve_orth_dtype


def orth_dtype_choice(orth_dtype: Any, method: str, device: torch.device | str) -> tuple[torch.dtype, str]:
    """``(dtype, why)``: the dtype ``method`` computes in on ``device`` with ``orth_dtype``
    (`muonclip.ortho.resolve_orth_dtype`) and a phrase saying why."""
    device = torch.device(device)
    m = METHODS[method]
    dtype = resolve_orth_dtype(orth_dtype, method, device)
    if orth_dtype is None:
        return dtype, f"method {method!r}'s default"
    if orth_dtype != AUTO:
        return dtype, "set by orth_dtype"
    if torch.bfloat16 not in m.dtypes:
        return dtype, f"method {method!r} computes in {_names(m.dtypes)}, by default in {_name(dtype)}"
    return dtype, native_bf16(device)[1]


def explain_orth_dtype(orth_dtype: Any, method: str, device: torch.device | str) -> str:
    """One line saying which dtype ``method`` computes in on ``device`` and why, e.g.
    ``"bfloat16 on cpu (auto: the CPU has AMX-BF16 and AVX512-BF16)"`` or ``"float32 on cpu
    (set by orth_dtype)"``."""
    dtype, why = orth_dtype_choice(orth_dtype, method, device)
    return f"{_name(dtype)} on {torch.device(device)} ({'auto: ' * (orth_dtype == AUTO)}{why})"


def orth_dtype_name(orth_dtype: Any) -> str:
    """``orth_dtype`` as a user writes it: ``"auto"``, ``"bfloat16"``, ``"float32"``..."""
    return _name(orth_dtype) if isinstance(orth_dtype, torch.dtype) else str(orth_dtype)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return "/".join(_name(d) for d in dtypes)
