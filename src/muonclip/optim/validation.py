"""What `muonclip.Muon` accepts: one check for its arguments, its param groups and loaded state.

`check_group` is the one validation: ``Muon.__init__`` runs it on the defaults,
``add_param_group`` on every group, ``load_state_dict`` on every group of the state dict, so a
setting is refused with the same message wherever it comes from. It raises

* ValueError naming the first hyperparameter that is not a finite number in its range (nan and
  inf never are: they would reach every weight), an unknown ``algorithm`` or orthogonalisation
  method, a group key that is missing, a 0-D/1-D tensor in a Muon group, or matrix keys that do
  not fit a weight (`muonclip.optim.matrices.matrix_spec`);
* TypeError for a complex parameter: Muon's orthogonalisation and update scale are defined for
  real matrices (a complex ``(A, B)`` viewed as real ``(A, 2B)`` would be another optimizer),
  so ``Muon`` refuses complex parameters when they are added, not at the first step.

`refuse_removed_keywords` turns a keyword argument of earlier versions into a TypeError that
names its replacement (docs/changelog.md lists them).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from torch import Tensor

from ..ortho import check_method
from .matrices import matrix_spec
from .scale import scale_name

ALGORITHMS = ("muon", "adamw")

GROUP_KEYS = ("algorithm", "lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
              "adjust_lr_fn", "method", "orth_dtype", "betas", "adamw_eps", "split_sizes", "split_groups", "flatten",
              "transposed", "normuon", "normuon_beta2", "cautious_weight_decay", "momentum_8bit")
"""The keys of every param group (besides ``params`` and the optional ``param_names``)."""

REMOVED_KEYWORDS = {
    "update_scale": "adjust_lr_fn (update_scale 'rms' -> 'match_rms_adamw', 'shape' -> 'original', "
                    "'none' -> 'unscaled')",
    "steps": "ns_steps",
    "split_sizes": "the param-group key 'split_sizes' (muonclip.param_groups sets it from the model)",
    "split_groups": "the param-group key 'split_groups' (muonclip.param_groups sets it from the model)",
    "flatten": "the param-group key 'flatten' (muonclip.param_groups sets it from the model)",
    "transposed": "the param-group key 'transposed' (muonclip.param_groups sets it from the model)",
}
"""Keyword arguments of ``Muon(...)`` in earlier versions -> what replaced them."""

RENAMED_GROUP_KEYS = {"update_scale": "adjust_lr_fn", "steps": "ns_steps"}
"""Param-group keys of earlier versions -> the keys that replaced them (a group with one is refused)."""

F = TypeVar("F", bound=Callable[..., Any])


def refuse_removed_keywords(init: F) -> F:
    """Wrap ``__init__`` so that a keyword of `REMOVED_KEYWORDS` raises a TypeError naming its
    replacement (the signature stays ``init``'s)."""

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        for key in kwargs.keys() & REMOVED_KEYWORDS.keys():
            raise TypeError(f"{type(self).__name__}() got the removed keyword argument {key!r}: use "
                            f"{REMOVED_KEYWORDS[key]} (docs/changelog.md)")
        init(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def number(value: Any) -> Any:
    """A hyperparameter as the step uses it: a one-element tensor (any shape: ``()``, ``(1,)``,
    ``(1, 1)``) as a Python float, anything else as it is."""
    return float(value) if isinstance(value, Tensor) else value


def _float(name: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def check_hyperparameters(options: Mapping[str, Any], where: str = "") -> None:
    """Raise a ValueError naming the first of lr, weight_decay, momentum, eps, adamw_eps,
    normuon_beta2, betas that is not a finite number in its range, or the first of normuon,
    cautious_weight_decay, momentum_8bit that is not a bool; ``where`` prefixes the name (e.g. "a param
    group's "). A one-element tensor counts as its value."""
    for key in ("lr", "weight_decay"):
        v = _float(f"{where}{key}", options[key])
        if not (math.isfinite(v) and v >= 0.0):
            raise ValueError(f"{where}{key} must be a finite number >= 0, got {options[key]!r}")
    if not 0.0 <= _float(f"{where}momentum", options["momentum"]) < 1.0:
        raise ValueError(f"{where}momentum must be in [0, 1), got {options['momentum']!r}")
    for key in ("eps", "adamw_eps"):
        v = _float(f"{where}{key}", options[key])
        if not (math.isfinite(v) and v > 0.0):
            raise ValueError(f"{where}{key} must be a finite number > 0, got {options[key]!r}")
    if not 0.0 <= _float(f"{where}normuon_beta2", options["normuon_beta2"]) < 1.0:
        raise ValueError(f"{where}normuon_beta2 must be in [0, 1), got {options['normuon_beta2']!r}")
    for key in ("normuon", "cautious_weight_decay", "momentum_8bit"):
        if not isinstance(options[key], bool):
            raise ValueError(f"{where}{key} must be True or False, got {options[key]!r}")
    betas = options["betas"]
    if len(betas) != 2 or not all(0.0 <= _float(f"{where}betas", b) < 1.0 for b in betas):
        raise ValueError(f"{where}betas must be two numbers in [0, 1), got {betas!r}")


def check_group(group: Mapping[str, Any], where: str = "a param group's ", context: str = "") -> None:
    """Validate a complete param group (every key of `GROUP_KEYS`, ``params``); see the module
    docstring. ``where`` prefixes the hyperparameter named in a message, ``context`` the other
    messages (a loaded state dict names the group)."""
    missing = [k for k in ("params", *GROUP_KEYS) if k not in group]
    if missing:
        raise ValueError(f"{context}keys {missing} are missing (a Muon param group has {list(GROUP_KEYS)})")
    for old, new in RENAMED_GROUP_KEYS.items():
        if old in group:
            raise ValueError(f"param group key {old!r} was replaced by {new!r} (torch.optim.Muon's name; "
                             "docs/changelog.md)")
    algorithm = group["algorithm"]
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{context}algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    check_hyperparameters(group, where)
    try:
        scale_name(group["adjust_lr_fn"])
        check_method(group["method"], group["ns_steps"], group["orth_dtype"], group["ns_coefficients"])
    except ValueError as e:
        raise ValueError(f"{context}{e}") from None
    names = group.get("param_names") or [None] * len(group["params"])
    for i, (p, name) in enumerate(zip(group["params"], names)):
        label = f"parameter '{name}'" if name else f"parameter {i} (shape {tuple(p.shape)})"
        if p.is_complex():
            raise TypeError(
                f"{label} is complex; muonclip.Muon optimizes real parameters only (its orthogonalisation and "
                "update scale are defined for real matrices). Keep complex weights in another optimizer, or store "
                "them as real tensors (torch.view_as_real) if a real optimizer is what you want"
            )
        if algorithm == "muon":
            if p.ndim < 2:
                raise ValueError(
                    f"{label} has shape {tuple(p.shape)}: Muon orthogonalises matrices, so 0-D/1-D "
                    "tensors (biases, norm gains, scalars) must go in an algorithm='adamw' group; "
                    "muonclip.param_groups(model) routes them for you"
                )
            matrix_spec(tuple(p.shape), group)


__all__ = ["ALGORITHMS", "GROUP_KEYS", "REMOVED_KEYWORDS", "RENAMED_GROUP_KEYS", "check_group",
           "check_hyperparameters", "number", "refuse_removed_keywords"]
