"""Flattened parameters: recognised and refused, never routed as vectors.

Muon orthogonalises each weight matrix whole. Two wrappers hand an optimizer 1-D pieces of
flattened matrices instead of the matrices:

* **FSDP1** (``torch.distributed.fsdp.FullyShardedDataParallel``): with
  ``use_orig_params=False`` the module's parameters become one ``FlatParameter`` per wrapped
  unit (marked ``_is_flat_param``); with ``use_orig_params=True`` each parameter keeps its name
  but, once sharded, holds a 1-D slice of the flat buffer. Either way the model holds
  ``FullyShardedDataParallel`` modules.
* **DeepSpeed ZeRO-3** partitions every parameter into flat pieces (marked ``ds_id``, with the
  original shape in ``ds_shape``); ZeRO-1/2 give the client optimizer flat fp32 partitions.

Taken at face value a flattened matrix looks like a vector (AdamW's branch), or fails the
shape check of a QK-Clip layout. `flat_kind` recognises each case from what the wrapper leaves
on the parameter or the model; `refuse_flat` and `refuse_flat_model` raise `FlatParameterError`
naming the wrapper and what to use instead: FSDP2 (``fully_shard``: DTensor parameters that keep
their shape, which Muon gathers whole per matrix), accelerate with ``fsdp_version=2``, Lightning's
``ModelParallelStrategy``, or DDP.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

INSTEAD = (
    "Muon orthogonalises whole matrices. Use FSDP2 instead (torch.distributed.fsdp.fully_shard; accelerate: "
    "FullyShardedDataParallelPlugin(fsdp_version=2); Lightning: ModelParallelStrategy), whose DTensor parameters "
    "keep their shape, or DDP"
)
"""What to use instead, in every message of this module."""

_FSDP1 = "FullyShardedDataParallel"
_MATRIX_MODULES = (nn.Linear, nn.Bilinear, nn.Embedding, nn.EmbeddingBag, nn.Conv1d, nn.Conv2d, nn.Conv3d)


class FlatParameterError(ValueError):
    """A parameter is a flattened piece of a matrix (FSDP1, DeepSpeed ZeRO), which Muon cannot optimize."""


def flat_kind(p: Tensor, module: nn.Module | None = None, attr: str = "") -> str | None:
    """Which wrapper flattened ``p``, or None when nothing says it is flattened.

    Args:
        p: a parameter.
        module: the module holding it, when known (default None): a 0-D/1-D ``weight`` of a
            linear, embedding or convolution module is a flattened matrix.
        attr: its attribute name in ``module`` (default ``""``).

    Returns:
        ``"FSDP1 (use_orig_params=False)"`` for a ``FlatParameter``, ``"DeepSpeed ZeRO"`` for a
        partitioned parameter, ``"a flattening wrapper (FSDP1 with use_orig_params=True?)"`` for a
        matrix module's weight that is not a matrix, else None.
    """
    if getattr(p, "_is_flat_param", False) or type(p).__name__ == "FlatParameter":
        return "FSDP1 (use_orig_params=False)"
    if hasattr(p, "ds_id") or hasattr(p, "ds_shape"):
        return "DeepSpeed ZeRO"
    if isinstance(module, _MATRIX_MODULES) and attr == "weight" and p.ndim < 2:
        return "a flattening wrapper (FSDP1 with use_orig_params=True?)"
    return None


def refuse_flat(p: Tensor, name: str = "", module: nn.Module | None = None, attr: str = "") -> None:
    """`FlatParameterError` when `flat_kind` recognises ``p`` (``name`` for the message)."""
    kind = flat_kind(p, module, attr)
    if kind is None:
        return
    what = f"parameter '{name}'" if name else "a parameter"
    shape = getattr(p, "ds_shape", None)
    whole = f" (of a matrix of shape {tuple(shape)})" if shape is not None else ""
    raise FlatParameterError(
        f"{what} of shape {tuple(p.shape)} is a flattened piece{whole} made by {kind}, not a weight as the model "
        f"defines it: routed as it is, a matrix would be taken for a vector. {INSTEAD}."
    )


def refuse_flat_model(model: Any) -> None:
    """`FlatParameterError` when ``model`` holds FSDP1 (``FullyShardedDataParallel``) modules or a
    parameter `flat_kind` recognises."""
    if not isinstance(model, nn.Module):
        return
    for mname, module in model.named_modules():
        if type(module).__name__ == _FSDP1:
            raise FlatParameterError(
                f"the model is wrapped in FSDP1 ({_FSDP1} at '{mname or 'the root'}'), which hands the optimizer "
                f"flattened 1-D pieces of its weight matrices (use_orig_params=True or False). {INSTEAD}."
            )
        for attr, p in module._parameters.items():
            if p is not None:
                refuse_flat(p, f"{mname}.{attr}" if mname else attr, module, attr)


__all__ = ["INSTEAD", "FlatParameterError", "flat_kind", "refuse_flat", "refuse_flat_model"]
