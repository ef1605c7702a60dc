"""What `muonclip.Muon` says when it is given parameters nobody routed, or a model.

Muon orthogonalises matrices; vectors, embeddings and the head belong to its AdamW branch, and
`muonclip.param_groups` (the model in, routed groups out) decides which is which. A group with no
``algorithm`` is a Muon group, so a plain list of every parameter — what the Hugging Face Trainer
passes an optimizer class in ``optimizer_cls_and_kwargs`` — puts biases and norm gains in Muon.
That is refused with an `UnroutedParametersError` (a TypeError, and a ValueError as the
check of a group's tensors has always raised) that says what to pass, before any group is added.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from .flat import refuse_flat

ADVICE = (
    "pass routed groups: Muon(muonclip.param_groups(model), ...) (or MuonClip(model, ...)); in the Hugging Face "
    "Trainer or TRL: optimizer_cls_and_kwargs=muonclip.integrations.hf.trainer_optimizer(Muon, lr=...), or "
    "optimizers=(Muon(muonclip.param_groups(model), ...), None)"
)
"""What to pass instead, in every message of this module."""


class UnroutedParametersError(TypeError, ValueError):
    """A Muon group with no ``algorithm`` holds a 0-D/1-D tensor: parameters nobody routed."""


def refuse_model(name: str, params: Any) -> None:
    """TypeError when ``params`` is a ``torch.nn.Module`` (``name``: the optimizer's class name)."""
    if isinstance(params, nn.Module):
        raise TypeError(f"{name} takes parameters or param groups, got the model {type(params).__name__}: {ADVICE}")


def refuse_unrouted(name: str, group: dict[str, Any]) -> None:
    """`UnroutedParametersError` when ``group`` has no ``algorithm`` (a Muon group by default) and holds a 0-D/1-D
    tensor: a plain list of parameters nobody routed; `muonclip.optim.flat.FlatParameterError` for a
    flattened piece of a matrix (FSDP1's ``FlatParameter``, a DeepSpeed ZeRO partition) in any group.
    Normalises ``group["params"]`` to a list."""
    params = group.get("params")
    if isinstance(params, Tensor):
        params = [params]
    elif params is not None and not isinstance(params, (set, list)):
        params = list(params)
    if params is not None:
        group["params"] = params
    names = group.get("param_names") or [None] * len(params or ())
    for p, n in zip(params or (), names):
        if isinstance(p, Tensor):
            refuse_flat(p, n or "")
    if "algorithm" in group or not params:
        return
    vector = next(((p, n) for p, n in zip(params, names) if isinstance(p, Tensor) and p.ndim < 2), None)
    if vector is not None:
        p, n = vector
        label = f"parameter '{n}' of shape {tuple(p.shape)}" if n else f"a tensor of shape {tuple(p.shape)}"
        raise UnroutedParametersError(
            f"{name} got parameters without routing (a param group with no 'algorithm', holding {label}): Muon "
            "orthogonalises matrices, so 0-D/1-D tensors must go in an algorithm='adamw' group, and a plain list "
            f"of every parameter (what Trainer(optimizer_cls_and_kwargs=({name}, {{...}})) passes) would give Muon "
            f"the vectors, embeddings and head. Instead, {ADVICE}."
        )
