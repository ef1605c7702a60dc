"""The ground floor: helpers that every layer may import, and that import nothing of muonclip.

* `dtensor` — DTensor geometry: which global indices each rank's local tensor holds, for any
  placement; the rank-local tensor; row shards for per-row scaling (QK-Clip).
* `triton_support` — whether Triton can run here (a GPU, or its CPU interpreter).
"""
