"""The compute dtype ``"auto"`` (`muonclip.common.defaults.ORTH_DTYPE`, every default's), per device.

``"auto"`` is bfloat16 where the device multiplies bfloat16 in hardware and float32 elsewhere
(`muonclip.common._hardware.native_bf16`):

* a CPU with AMX-BF16 or AVX512-BF16 (Intel Sapphire Rapids and later, AMD Zen 4 and later):
  bfloat16; any other CPU (AVX2 or AVX512F only, Arm): float32, because torch's bfloat16
  products there are emulated and slower than float32's;
* a CUDA device of compute capability 8.0 or more (bfloat16 tensor cores: A100, H100...):
  bfloat16; an older one (V100 is 7.0): float32;
* any other device type (MPS, XPU...): float32.

What the device has is read from what it declares, never by timing. `muonclip.ortho.resolve_orth_dtype`
applies the rule to a method: one that cannot compute in bfloat16 (``"svd"``) gets its own default
dtype (float64); ``None`` is the method's own default dtype on every device (bfloat16 for the
iterative methods); a dtype is used as it is.

Either dtype runs the same algorithm; only the rounding differs (docs/design.md, "Compute dtype").
"""

from __future__ import annotations

import torch

from ..common._hardware import native_bf16


def auto_dtype(device: torch.device | str) -> torch.dtype:
    """``"auto"`` for a method that computes in bfloat16: bfloat16 where ``device`` multiplies it
    natively, else float32."""
    return torch.bfloat16 if native_bf16(device)[0] else torch.float32
