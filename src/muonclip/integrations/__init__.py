"""Integrations: Hugging Face (QK-Clip for transformers models and the Trainer callback),
PyTorch Lightning, TensorBoard.

Each integration lives in its own module and imports its framework only when that module is
imported, so ``import muonclip`` (and ``import muonclip.integrations``) needs only torch::

    from muonclip.integrations.hf import MuonClipTrainerCallback, attach     # pip install 'muonclip[hf]'
    from muonclip.integrations.lightning import MuonClipLightningCallback     # pip install 'muonclip[lightning]'
    from muonclip.integrations.tensorboard import TensorBoardWriter           # pip install 'muonclip[tensorboard]'

The names are also reachable as attributes of this package (``muonclip.integrations.
MuonClipTrainerCallback``), imported on first access. The framework-free pieces the callbacks
share — finding the `muonclip.Muon` under a framework's optimizer wrapper, the update RMS and
the per-step metrics — are in `muonclip.qkclip.step_metrics`.

Importing this package registers `hf_layers` with `muonclip.qkclip.register_discoverer`, so that
`muonclip.MuonClip` finds a transformers model's attention layers, the family table
(`muonclip.integrations.families`: every model family's fused projections, head counts, q/k
norms and adapter names) with `muonclip.common.families`, which `muonclip.param_groups` and
the clip read, and `accelerate_wrappers` as a build hook of `muonclip.Muon`
(`muonclip.optim._wrappers`), so that accelerate's optimizer wrapper passes a muonclip
optimizer's attributes on (``import muonclip`` does all three).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from torch import nn

from ..optim._wrappers import register_build_hook
from ..qkclip._discovery import register_discoverer
from ..qkclip._layouts import AttentionLayer
from ..qkclip.step_metrics import StepMetrics, UpdateRMS, step_metrics, unwrap_optimizer
from . import deepspeed as _deepspeed  # noqa: F401  (registers the DeepSpeed ZeRO driver; imports no deepspeed)
from . import families as _families  # noqa: F401  (registers the family table)

_LAZY = {
    "MuonClipTrainerCallback": ".hf",
    "MuonClipLightningCallback": ".lightning",
    "TensorBoardWriter": ".tensorboard",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def hf_layers(model: nn.Module) -> list[AttentionLayer] | None:
    """`muonclip.integrations.hf.attach` for a transformers ``PreTrainedModel`` or a module holding
    one (a peft ``PeftModel`` / ``LoraModel``, a user's wrapper), else None (transformers is
    imported only when it already is: a transformers model means it is)."""
    if "transformers" not in sys.modules:
        return None
    from transformers import PreTrainedModel

    if not any(isinstance(m, PreTrainedModel) for m in model.modules()):
        return None
    from .hf import attach

    return attach(model)


register_discoverer(hf_layers)


def accelerate_wrappers() -> None:
    """Build hook of `muonclip.Muon`: once accelerate is imported, its ``AcceleratedOptimizer`` passes
    a muonclip optimizer's attributes on (`muonclip.integrations.accelerate.install`); accelerate
    is never imported here."""
    if "accelerate.optimizer" in sys.modules:
        from .accelerate import install

        install()


register_build_hook(accelerate_wrappers)

__all__ = [
    "MuonClipLightningCallback", "MuonClipTrainerCallback", "StepMetrics", "TensorBoardWriter", "UpdateRMS",
    "accelerate_wrappers", "hf_layers", "step_metrics", "unwrap_optimizer",
]
