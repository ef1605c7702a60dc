"""The orthogonalisation's compute dtype: ``orth_dtype="auto"``, resolved per device.

``"auto"`` (`muonclip.Muon`'s default) is bfloat16 where the device multiplies bfloat16 in
hardware and float32 elsewhere:

* a CPU with AMX-BF16 or AVX512-BF16 (Intel Sapphire Rapids and later, AMD Zen 4 and later):
  bfloat16; any other CPU (AVX2 or AVX512F only, Arm): float32, because torch's bfloat16
  products there are emulated and slower than float32's;
* a CUDA device of compute capability 8.0 or more (bfloat16 tensor cores: A100, H100...):
  bfloat16; an older one (V100 is 7.0): float32;
* any other device type (MPS, XPU...): float32.

What the device has is read once from what it declares (`muonclip.common._hardware`), never by
timing. The resolution is per device of the parameters, when the step builds its buckets, so in
one optimizer a model on a GPU and parameters offloaded to the CPU each get their own; a
checkpoint saves ``"auto"`` itself, and resumed on another kind of machine resolves again there.
A method that cannot compute in bfloat16 (``"svd"``) gets its own default dtype (float64).

Either dtype runs the same algorithm; only the rounding differs, so results on two kinds of
machine differ as bfloat16 and float32 runs differ on one (docs/design.md, "Compute dtype").
An explicit ``orth_dtype`` (``torch.bfloat16``, ``torch.float32``...) is used on every device.
"""

from __future__ import annotations

from typing import Any

import torch

from ..common._hardware import cpu_bf16_instructions, cuda_capability
from ..ortho import METHODS

AUTO = "auto"
"""``orth_dtype="auto"``: bfloat16 where the device multiplies it natively, else float32."""

CUDA_BF16_CAPABILITY = (8, 0)
"""The first CUDA compute capability with bfloat16 tensor cores (Ampere)."""


def native_bf16(device: torch.device | str) -> tuple[bool, str]:
    """Whether ``device`` multiplies bfloat16 natively, and why (a phrase naming what was found)."""
    device = torch.device(device)
    if device.type == "cpu":
        found = cpu_bf16_instructions()
        if found:
            return True, f"the CPU has {' and '.join(found)}"
        return False, "the CPU has no bfloat16 matrix instructions (AMX-BF16, AVX512-BF16): bfloat16 is emulated"
    if device.type == "cuda":
        (major, minor), name = cuda_capability(device)
        if (major, minor) >= CUDA_BF16_CAPABILITY:
            return True, f"{name} (compute capability {major}.{minor}) has bfloat16 tensor cores"
        return False, f"{name} (compute capability {major}.{minor}) has no bfloat16 tensor cores (8.0 and later)"
    return False, f"bfloat16 products are not known to be native on {device.type}"


def resolve_orth_dtype(orth_dtype: Any, method: str, device: torch.device | str) -> torch.dtype | None:
    """The dtype a bucket of ``method`` on ``device`` is orthogonalised in: ``orth_dtype`` itself
    unless it is ``"auto"`` (None: the method's default dtype, `muonclip.ortho.Method`)."""
    if orth_dtype != AUTO:
        return orth_dtype
    m = METHODS[method]
    if torch.bfloat16 not in m.dtypes:
        return m.default_dtype
    return torch.bfloat16 if native_bf16(device)[0] else torch.float32


def orth_dtype_choice(orth_dtype: Any, method: str, device: torch.device | str) -> tuple[torch.dtype, str]:
    """``(dtype, why)``: the dtype ``method`` computes in on ``device`` with ``orth_dtype``
    (`resolve_orth_dtype`, the method's default for None) and a phrase saying why."""
    device = torch.device(device)
    m = METHODS[method]
    dtype = resolve_orth_dtype(orth_dtype, method, device)
    if dtype is None:
        return m.default_dtype, f"method {method!r}'s default"
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
