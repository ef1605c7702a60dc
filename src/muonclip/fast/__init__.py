"""Fast paths, each opt-in unless measured better on the default path (docs/benchmarks.md).

Layers on the core (`muonclip.ortho`, `muonclip.optim`), which never imports them; importing
this package registers them (``import muonclip`` does):

* workspace ``"buffered"`` (`BufferedWorkspace`): Muon's buckets orthogonalised into buffers reused
  by every bucket of a step and freed when it ends, on CPU; optional CPU chunking
  (`muonclip.fast._buffered.chunk_size`). The default for CPU parameters
  (``Muon(workspace="auto")``), measured faster there; ``workspace="core"`` turns it off.
* method ``"ns5_sym"`` (`muonclip.fast._symmetric`): the quintic computing only half of its
  symmetric products (row strips on CPU, the Triton kernel of `muonclip.fast._triton_syrk` on
  CUDA). Opt-in.
* method ``"ns5_compiled"`` (`muonclip.fast._compiled`): the quintic through ``torch.compile``.
  Opt-in.

``on_nonfinite="mask"`` (the sync-free skip) is a wrapper of the optimizer step, in
`muonclip.optim._nonfinite_mask`.
"""

from __future__ import annotations

import torch

from ..optim.workspace import register_workspace
from ..ortho import ITERATIVE_DTYPES, Method, ns5_schedule, register_method
from ._buffered import BufferedWorkspace
from ._compiled import compiled_newton_schulz
from ._symmetric import symmetric_newton_schulz


def _ns5_sym(V, steps, dtype, eps, coefficients):
    return symmetric_newton_schulz(V, ns5_schedule(steps, coefficients), dtype=dtype, eps=eps)


def _ns5_compiled(V, steps, dtype, eps, coefficients):
    return compiled_newton_schulz(V, ns5_schedule(steps, coefficients), dtype=dtype, eps=eps)


register_method("ns5_sym", Method(_ns5_sym, 5, torch.bfloat16, ITERATIVE_DTYPES, takes_coefficients=True))
register_method("ns5_compiled", Method(_ns5_compiled, 5, torch.bfloat16, ITERATIVE_DTYPES, takes_coefficients=True))
register_workspace("buffered", BufferedWorkspace, auto_for=("cpu",))

__all__ = ["BufferedWorkspace"]
