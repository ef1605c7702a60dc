"""Whether Triton kernels can run: the package is importable, and a GPU or the interpreter.

Used by every Triton kernel of the package (`muonclip.fast._triton_syrk`,
`muonclip.attention._triton_max_logits`), so that a layer does not import another for it.
"""

from __future__ import annotations

import functools
import importlib.util
import os


@functools.cache
def triton_available() -> bool:
    """True when the ``triton`` package can be imported (it comes with CUDA builds of PyTorch);
    looked up once (the lookup costs tens of microseconds, and attention calls ask on every call)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton's interpreter is on (``TRITON_INTERPRET=1``): kernels run on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
