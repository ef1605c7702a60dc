"""The ground floor: helpers that every layer may import, and that import nothing of muonclip.

Public modules (the package itself exports no name):

* `families` — the model-family table's format and its registry (`register_families`).
* `family_readers` — the readers of the registered table, one function per fact.
* `defaults` — every default the functions and classes share (Muon's, the orthogonaliser's,
  QK-Clip's tau), in one place.

Internal:

* `_dtensor` — DTensor geometry: which global indices each rank's local tensor holds, for any
  placement; the rank-local tensor; row shards for per-row scaling (QK-Clip).
* `_triton_support` — whether Triton can run here (a GPU, or its CPU interpreter).
* `_hardware` — what the hardware multiplies natively (`native_bf16`, and ``MUONCLIP_CPU_BF16``,
  which tells it the CPU's answer).
"""

__all__: list[str] = []
