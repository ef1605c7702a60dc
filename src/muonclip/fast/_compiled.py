"""``torch.compile``d Newton–Schulz (opt-in: ``method="ns5_compiled"``).

The quintic (`muonclip.ortho.newton_schulz`) compiled with inductor,
``fullgraph=True, dynamic=False``: each distinct (batch shape, dtype) compiles once (dynamo's
recompile limit, 8 by default, then falls back to eager with a warning). Only the
orthogonalisation is compiled, so optimizer hyperparameters (lr, weight decay, momentum)
are not inputs and changing them never recompiles; the coefficients and eps are constants
of the graph.

On CPU it compiles for seconds per shape and then runs about as fast as eager
(docs/benchmarks.md has the figures, with the machine). The matrix products
dominate and inductor only fuses the normalisation and the casts; its C++ GEMM template
(``max_autotune``), which could fuse the quintic's additions into the products, ran those
products slower than eager ``baddbmm`` on the CPUs we measured (`benchmarks/bench_accumulate.py`). It does not
pay for short CPU runs; on GPU it removes launch overhead and is CUDA-graph friendly. Results
differ from eager by bf16 round-off (different fusion): tests compare at bf16 tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..common import defaults as D
from ..ortho._newton_schulz import newton_schulz
from ..ortho._precision import auto_dtype

_COMPILED: list[Callable[..., Tensor]] = []


def compiled_newton_schulz(
    V: Tensor,  # (..., A, B)
    coefficients: Sequence[tuple[float, float, float]],
    *,
    dtype: torch.dtype | str = D.ORTH_DTYPE,
    eps: float = D.EPS,
    norm_scale: float = 1.0,
) -> Tensor:
    """`newton_schulz` through ``torch.compile`` (compiled lazily on the first call)."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(newton_schulz, fullgraph=True, dynamic=False))
    coeffs = [tuple(float(x) for x in c) for c in coefficients]
    dtype = auto_dtype(V.device) if dtype == D.AUTO else dtype
    return _COMPILED[0](V, coeffs, dtype=dtype, eps=eps, norm_scale=norm_scale)
