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
``ModelParallelStrategy``, or DDP; for DeepSpeed, its partitions driven by
`muonclip.integrations.deepspeed` (`DEEPSPEED`).

**The extension point for a wrapper that steps the optimizer on flat partitions.** DeepSpeed's
ZeRO optimizers replace the optimizer's parameters by flat partitions of whole param groups and
call ``step()`` once per group. A layer that knows such a wrapper registers a finder
(`register_flat_driver`); `flat_driver` asks it whether the optimizer is being stepped by one
(`muonclip.Muon` asks when its param groups changed since its last step -- the wrapper swapped in
its partitions -- and at `state_dict`/`load_state_dict`; a finder that attaches a driver stores it
on the optimizer as `ATTACHED`, which the step reads first), and `muonclip.Muon.step` then hands
the step to the `FlatDriver`
(`muonclip.integrations.deepspeed` registers one when ``muonclip`` is imported; it knows which
element range of every weight each rank's partition holds). The core imports no wrapper.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from torch import Tensor, nn

INSTEAD = (
    "Muon orthogonalises whole matrices. Use FSDP2 instead (torch.distributed.fsdp.fully_shard; accelerate: "
    "FullyShardedDataParallelPlugin(fsdp_version=2); Lightning: ModelParallelStrategy), whose DTensor parameters "
    "keep their shape, or DDP"
)
"""What to use instead, in every message of this module."""

DEEPSPEED = (
    "Under DeepSpeed pass the MuonClip (or Muon) built on the unpartitioned model as deepspeed.initialize(model=..., "
    "optimizer=...) with zero_allow_untested_optimizer; muonclip steps DeepSpeed's ZeRO-0/1/2/3 partitions "
    "(muonclip.integrations.deepspeed, docs/integrations.md, \"DeepSpeed\")"
)
"""What to do about DeepSpeed's flat pieces, in the messages that meet them outside a DeepSpeed step."""

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
    fix = f"{DEEPSPEED}." if kind == "DeepSpeed ZeRO" else f"{INSTEAD}."
    raise FlatParameterError(
        f"{what} of shape {tuple(p.shape)} is a flattened piece{whole} made by {kind}, not a weight as the model "
        f"defines it: routed as it is, a matrix would be taken for a vector. {fix}"
    )


def refuse_flat_model(model: Any, *, named: Sequence[tuple[str, nn.Module]] | None = None) -> None:
    """`FlatParameterError` when ``model`` holds FSDP1 (``FullyShardedDataParallel``) modules or a
    parameter `flat_kind` recognises (``named``: ``model.named_modules()``, when the caller has it)."""
    if not isinstance(model, nn.Module):
        return
    for mname, module in model.named_modules() if named is None else named:
        if type(module).__name__ == _FSDP1:
            raise FlatParameterError(
                f"the model is wrapped in FSDP1 ({_FSDP1} at '{mname or 'the root'}'), which hands the optimizer "
                f"flattened 1-D pieces of its weight matrices (use_orig_params=True or False). {INSTEAD}."
            )
        for attr, p in module._parameters.items():
            if p is not None:
                refuse_flat(p, f"{mname}.{attr}" if mname else attr, module, attr)


class FlatDriver(Protocol):
    """What steps an optimizer on a wrapper's flat partitions (`register_flat_driver`)."""

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The optimizer's ``step()`` as the wrapper calls it (once per param group for DeepSpeed)."""
        ...

    def active(self) -> bool:
        """True while the optimizer's param groups hold the wrapper's partitions (not its own parameters)."""
        ...


ATTACHED = "_attached_flat_driver"
"""The optimizer attribute (in its ``__dict__``) where a finder stores the `FlatDriver` it attached."""

_FINDERS: list[Callable[[Any], FlatDriver | None]] = []
_PARTITION = "_muonclip_flat_partition"


def mark_partition(t: Tensor) -> None:
    """Mark ``t`` as a wrapper's flat partition of several weights that a `FlatDriver` steps (and
    checks, on the weights' own shapes): the core's checks of a Muon group then pass over it."""
    setattr(t, _PARTITION, True)


def is_partition(t: Tensor) -> bool:
    """True for a tensor `mark_partition` marked."""
    return bool(getattr(t, _PARTITION, False))


def register_flat_driver(find: Callable[[Any], FlatDriver | None]) -> None:
    """Register ``find(optimizer)``: the `FlatDriver` of a wrapper stepping ``optimizer`` on flat
    partitions, or None (cheap: `flat_driver` calls it whenever the param groups changed)."""
    if find not in _FINDERS:
        _FINDERS.append(find)


def flat_driver(optimizer: Any) -> FlatDriver | None:
    """The registered `FlatDriver` stepping ``optimizer`` now, or None (the optimizer steps its own parameters)."""
    for find in _FINDERS:
        driver = find(optimizer)
        if driver is not None:
            return driver
    return None


__all__ = ["ATTACHED", "DEEPSPEED", "INSTEAD", "FlatDriver", "FlatParameterError", "flat_driver", "flat_kind",
           "is_partition", "mark_partition", "refuse_flat", "refuse_flat_model", "register_flat_driver"]
