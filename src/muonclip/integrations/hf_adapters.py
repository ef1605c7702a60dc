"""peft adapters on q/k projections: which tensors QK-Clip scales (docs/design.md, "QK-Clip on adapters").

A peft model (``get_peft_model``) keeps a transformers model inside it and replaces targeted
projections by wrappers; the attention modules and their head counts are unchanged, so
`muonclip.integrations.hf.attach` finds them through the wrapper. What changes is which tensor
stands for a projection's rows. Read from each projection's structure (peft is never imported):

* **DoRA** (``LoraConfig(use_dora=True)``; a LoRA layer whose ``use_dora[adapter]`` is set): the
  effective weight is ``W' = m * (W0 + s B A) / ||W0 + s B A||_row``, so row r of ``W'`` is
  ``m[r]`` times a unit row that does not depend on ``m``: scaling ``m[r]`` scales row r exactly.
  The projection's rows are the adapter's magnitude vector (`muonclip.qkclip.Magnitudes`), which
  is trainable and saved with the adapter; ``W0`` (quantized or not), ``A`` and ``B`` are never
  touched. The bias is added after the magnitudes, so a q/k bias is scaled as a bias (and must
  be trainable: peft's ``bias="all"``).
* **plain LoRA** (and other additive adapters): ``W0 + s B A`` has no exact row scale through
  ``B`` and ``A`` alone; the projection's rows are the frozen base weight, which the rule of
  `muonclip.qkclip.clip_targets` refuses with that explanation and the alternatives.
* **modules_to_save** (a ``ModulesToSaveWrapper``): the active trainable copy, a plain layer,
  saved with the adapter.

A DoRA adapter merged into its base, disabled, or several adapters active at once leave no
magnitude vector that alone scales the output: refused (ValueError).
"""

from __future__ import annotations

from torch import Tensor, nn

from ..qkclip._rows import Magnitudes
from .families import ADAPTER_BASE, ADAPTER_COPIES, DORA_MAGNITUDE, LORA_A


def is_modules_to_save(module: nn.Module) -> bool:
    """Whether ``module`` is peft's ``ModulesToSaveWrapper`` (a trainable copy of a module, by structure)."""
    return isinstance(getattr(module, ADAPTER_COPIES, None), nn.ModuleDict) and hasattr(module, "original_module")


def is_lora_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a peft LoRA/DoRA layer (a ``base_layer`` with ``lora_A`` / ``lora_B`` adapters)."""
    return isinstance(getattr(module, ADAPTER_BASE, None), nn.Module) and isinstance(
        getattr(module, LORA_A, None), nn.ModuleDict
    )


def _active(module: nn.Module, layer: str, attr: str) -> str:
    active = getattr(module, "active_adapters", None) or []
    if isinstance(active, str):
        active = [active]
    if len(active) != 1:
        raise ValueError(
            f"attention layer '{layer}': projection '{attr}' has {len(active)} active adapters ({list(active)}); "
            "QK-Clip scales the rows of one adapter's projection. Activate one (peft_model.set_adapter(name))."
        )
    return active[0]


def unwrap(module: nn.Module, layer: str, attr: str) -> nn.Module:
    """The module that computes projection ``attr``: the active copy of a ``ModulesToSaveWrapper``,
    else ``module`` itself (a LoRA layer stays as it is: see `projection_rows`)."""
    if not is_modules_to_save(module):
        return module
    if getattr(module, "disable_adapters", False):
        return module.original_module
    return getattr(module, ADAPTER_COPIES)[_active(module, layer, attr)]


def projection_rows(module: nn.Module, layer: str, attr: str) -> tuple[Tensor | Magnitudes, Tensor | None]:
    """``(rows, bias)`` QK-Clip scales for projection ``attr`` of attention layer ``layer``.

    A DoRA layer gives its active adapter's magnitude vector as `Magnitudes` and the base bias;
    any other layer its ``weight`` and ``bias`` (for a LoRA layer: the base weight, which the
    rule of `muonclip.qkclip.clip_targets` refuses when frozen).

    Raises:
        ValueError: a DoRA adapter merged, disabled, or with several adapters active.
    """
    module = unwrap(module, layer, attr)
    if not is_lora_layer(module):
        return module.weight, getattr(module, "bias", None)
    base = getattr(module, ADAPTER_BASE)
    dora = getattr(module, "use_dora", {}) or {}
    if any(dora.values()):
        adapter = _active(module, layer, attr)
        if getattr(module, "merged", False) or getattr(module, "disable_adapters", False) or not dora.get(adapter):
            raise ValueError(
                f"attention layer '{layer}': the DoRA adapter of '{attr}' is merged into its base, disabled or not "
                "active, so its magnitude vector does not scale the projection's output and QK-Clip has no exact "
                "row scale. Unmerge / enable it (or merge_and_unload() and train the merged weights in full)."
            )
        return Magnitudes(getattr(module, DORA_MAGNITUDE)[adapter].weight), getattr(base, "bias", None)
    return base.weight, getattr(base, "bias", None)


__all__ = ["is_lora_layer", "is_modules_to_save", "projection_rows", "unwrap"]
