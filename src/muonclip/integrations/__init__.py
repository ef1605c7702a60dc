"""Integrations: Hugging Face Trainer and PyTorch Lightning callbacks, a TensorBoard writer.

Each integration lives in its own module and imports its framework only when that module is
imported, so ``import muonclip`` (and ``import muonclip.integrations``) needs only torch::

    from muonclip.integrations.hf_trainer import MuonClipTrainerCallback      # pip install 'muonclip[hf]'
    from muonclip.integrations.lightning import MuonClipLightningCallback     # pip install 'muonclip[lightning]'
    from muonclip.integrations.tensorboard import TensorBoardWriter           # pip install 'muonclip[tensorboard]'

The names are also reachable as attributes of this package (``muonclip.integrations.
MuonClipTrainerCallback``), imported on first access. The framework-free pieces the callbacks
share — finding the `muonclip.Muon` under a framework's optimizer wrapper, the update RMS and
the per-step metrics — are in `muonclip.integrations.stats`.
"""

from __future__ import annotations

import importlib
from typing import Any

from .stats import StepMetrics, UpdateRMS, step_metrics, unwrap_optimizer

_LAZY = {
    "MuonClipTrainerCallback": ".hf_trainer",
    "MuonClipLightningCallback": ".lightning",
    "TensorBoardWriter": ".tensorboard",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MuonClipLightningCallback", "MuonClipTrainerCallback", "StepMetrics", "TensorBoardWriter", "UpdateRMS",
    "step_metrics", "unwrap_optimizer",
]
