"""What `muonclip.Muon` accepts: one check for its arguments, its param groups and loaded state,
and each step's numbers and gradients.

`check_group` is the one validation: ``Muon.__init__`` runs it on the defaults,
``add_param_group`` on every group, ``load_state_dict`` on every group of the state dict, so a
setting is refused with the same message wherever it comes from. It raises

* ValueError naming the first hyperparameter that is not a number of its kind (an int or a float,
  or a one-element real tensor with a value: not a string, not a tensor on the meta device), not
  finite and in its range (nan and inf never are: they would reach every weight), or so large
  that what the step computes from it overflows the parameters' dtype (`check_step_scalars`:
  ``lr * weight_decay``, Muon's ``lr * scale`` of each matrix, AdamW's ``lr / (1 - beta1)``);
  a flag that is not True or False; an unknown ``algorithm`` or orthogonalisation method, an
  ``orth_dtype`` that is not ``"auto"``, None or a dtype the method computes in, a group key that
  is missing, a 0-D/1-D tensor in a Muon group, or matrix keys that do not fit a weight
  (`muonclip.optim._matrices.matrix_spec`);
* TypeError for a complex parameter: Muon's orthogonalisation and update scale are defined for
  real matrices (a complex ``(A, B)`` viewed as real ``(A, 2B)`` would be another optimizer),
  so ``Muon`` refuses complex parameters when they are added, not at the first step.

The step itself reads a group's values again before it changes anything (`StepLimits`,
`step_numbers`): ``lr`` and ``weight_decay`` (which schedulers set between steps) at every step,
the rest whenever one of them changed, so a value set between steps is refused before any
parameter or counter moves, never half-way through a step.

**Non-finite gradients**: none may reach a weight or an optimizer buffer. Three policies
(``Muon(on_nonfinite=...)``):

* ``"raise"`` (default) and ``"skip"`` look at every gradient before the step
  (`finite_per_tensor`, then `nonfinite_indices`: one host sync per step, the answer decides a
  Python branch). ``raise`` names the bad parameters (`NonFiniteGradError`); ``skip`` returns
  without touching anything.
* ``"mask"`` decides on the device, with no host sync: the step runs on zeroed gradients and is
  undone where the flag is set (`muonclip.optim._nonfinite_mask.MaskedStep`).

Under FSDP2 each rank sees its own shards: the flags are computed on the local shards and the
distributed layer AND-s them over the ranks (`muonclip.optim.multiprocess.Engine.all_finite`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..common.defaults import AUTO
from ..ortho import check_method
from ._matrices import matrix_spec
from ._scale import scale_name
from .flat import is_partition

ALGORITHMS = ("muon", "adamw")

GROUP_KEYS = ("algorithm", "lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
              "adjust_lr_fn", "method", "orth_dtype", "betas", "adamw_eps", "split_sizes", "split_groups", "flatten",
              "transposed", "normuon", "normuon_beta2", "cautious_weight_decay", "momentum_8bit")
"""The keys of every param group (besides ``params`` and the optional ``param_names``)."""

ON_NONFINITE = ("raise", "skip", "mask")
"""The values of ``Muon(on_nonfinite=...)`` (module docstring)."""

GRAD_LIMIT = 2.0**100
"""The largest gradient entry a step accepts; a larger one counts as non-finite. Muon's float32
momentum ``M = mu M + G`` and its input ``G + mu M`` stay below ``|G|_max / (1 - mu)``, which
must fit float32 (largest value about ``2^128``): every ``mu`` below ``1 - 2^-27`` does with
this limit, while a gradient of 3e38 (or a steady 2e37 for 36 steps at ``mu`` = 0.95) would
overflow to inf and end as NaN weights. No gradient of a training run that has not diverged
comes near ``2^100`` (about 1.3e30)."""


class NonFiniteGradError(FloatingPointError):
    """A gradient holds NaN or inf (or an entry beyond `GRAD_LIMIT`); the step was not applied to any
    parameter."""


def number(value: Any) -> Any:
    """A hyperparameter as the step uses it: a one-element tensor (any shape: ``()``, ``(1,)``,
    ``(1, 1)``) as a Python float, anything else as it is."""
    return float(value) if isinstance(value, Tensor) else value


def _float(name: str, value: Any) -> float:
    """``value`` as a float: an int or a float (not a bool, not a string), or a one-element real
    tensor that holds a value (not on the meta device); else a ValueError naming ``name``."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{name} must be a number or a one-element real tensor, got a tensor of shape "
                             f"{tuple(value.shape)} and dtype {value.dtype}")
        if value.device.type == "meta":
            raise ValueError(f"{name} is a tensor on the meta device, which holds no value; give a number or a "
                             "tensor on a real device")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number (an int or a float), got {value!r} ({type(value).__name__})")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number, got an int of {value.bit_length()} bits") from None


def _pair(name: str, value: Any) -> tuple[Any, Any]:
    """``value`` as a pair (a tuple or list of two); else a ValueError naming ``name``."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{name} must be two numbers in [0, 1), got {value!r}")
    return value[0], value[1]


def check_hyperparameters(options: Mapping[str, Any], where: str = "") -> None:
    """Raise a ValueError naming the first of lr, weight_decay, momentum, eps, adamw_eps,
    normuon_beta2, betas that is not a finite number in its range, or the first of nesterov,
    normuon, cautious_weight_decay, momentum_8bit that is not a bool; ``where`` prefixes the name
    (e.g. "a param group's "). A one-element tensor counts as its value; a string, a bool or a
    tensor without a value (on the meta device) is not a number."""
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
    for key in ("nesterov", "normuon", "cautious_weight_decay", "momentum_8bit"):
        if not isinstance(options[key], bool):
            raise ValueError(f"{where}{key} must be True or False, got {options[key]!r}")
    betas = _pair(f"{where}betas", options["betas"])
    if not all(0.0 <= _float(f"{where}betas", b) < 1.0 for b in betas):
        raise ValueError(f"{where}betas must be two numbers in [0, 1), got {options['betas']!r}")


@dataclass(frozen=True)
class StepLimits:
    """What bounds the numbers a step of one param group computes (`group_limits`).

    Attributes:
        scale: the largest update scale of the group's Muon matrices (`muonclip.optim._scale`;
            0.0 for an AdamW group): the step subtracts ``lr * scale * O``.
        dtype_max: the largest value of the narrowest floating dtype among the group's parameters
            (float16: 65504; bfloat16 and float32: about 3.4e38): every coefficient the step
            applies to a parameter (``lr * scale``, ``lr * weight_decay``, AdamW's
            ``lr / (1 - beta1^t)``) must fit it, or torch fails half-way through the step.
        state_max: the largest float32 value (the optimizer state's dtype; float64 for float64
            parameters): AdamW's epsilon is added to its moments.
    """

    scale: float
    dtype_max: float
    state_max: float


def group_limits(group: Mapping[str, Any], specs: Sequence[Any] = ()) -> StepLimits:
    """The `StepLimits` of ``group`` (``specs``: the `muonclip.optim._matrices.MatrixSpec` of each
    of its Muon parameters, already computed)."""
    floats = [p.dtype for p in group["params"] if p.is_floating_point()]
    dtype_max = min((torch.finfo(d).max for d in floats), default=math.inf)
    state_max = min((torch.finfo(torch.promote_types(d, torch.float32)).max for d in floats), default=math.inf)
    scale = max((s for spec in specs for s in spec.scales), default=0.0)
    return StepLimits(scale, dtype_max, state_max)


def check_step_scalars(group: Mapping[str, Any], limits: StepLimits, where: str = "") -> None:
    """Raise a ValueError when a coefficient the step computes from ``group``'s (valid)
    hyperparameters overflows its parameters' dtype (`StepLimits`); the message names the
    hyperparameter and the largest value that fits."""
    lr, wd = _float(f"{where}lr", group["lr"]), _float(f"{where}weight_decay", group["weight_decay"])
    if group["algorithm"] == "muon":
        factors = {"its largest update scale": limits.scale}
    else:
        beta1 = _float(f"{where}betas", _pair(f"{where}betas", group["betas"])[0])
        factors = {"1 / (1 - beta1), AdamW's first bias correction": 1.0 / (1.0 - beta1)}
        eps = _float(f"{where}adamw_eps", group["adamw_eps"])
        if eps > limits.state_max:
            raise ValueError(f"{where}adamw_eps={eps:g} does not fit the optimizer state's dtype (largest "
                             f"{limits.state_max:.4g})")
    factors["weight_decay"] = wd
    for what, factor in factors.items():
        if lr * factor > limits.dtype_max:
            raise ValueError(
                f"{where}lr={lr:g} is too large: the step multiplies it by {what} ({factor:.4g}), which gives "
                f"{lr * factor:.4g}, beyond the largest value of the parameters' dtype ({limits.dtype_max:.4g}); "
                f"use lr <= {limits.dtype_max / factor:.4g}")


def step_numbers(group: Mapping[str, Any], limits: StepLimits, where: str = "") -> tuple[float, float]:
    """``(lr, weight_decay)`` of an already validated ``group`` as floats, for a step: the fast
    path checks what a scheduler may have set since (``lr`` and ``weight_decay``: their kind,
    range and the coefficients of `check_step_scalars`); anything wrong raises the ValueError of
    `check_hyperparameters` or `check_step_scalars`, before the step changes anything."""
    lr, wd = group["lr"], group["weight_decay"]
    try:
        if type(lr) is not float or type(wd) is not float:
            lr, wd = _float(f"{where}lr", lr), _float(f"{where}weight_decay", wd)
        factor = max(wd, limits.scale if group["algorithm"] == "muon" else 1.0 / (1.0 - group["betas"][0]))
        if 0.0 <= lr and 0.0 <= wd and lr * factor <= limits.dtype_max:  # False for NaN
            return lr, wd
    except (TypeError, ValueError, ZeroDivisionError):  # a value of the wrong kind: the full check names it
        pass
    check_hyperparameters(group, where)
    check_step_scalars(group, limits, where)
    return _float(f"{where}lr", group["lr"]), _float(f"{where}weight_decay", group["weight_decay"])


def check_group(group: Mapping[str, Any], where: str = "a param group's ", context: str = "") -> StepLimits:
    """Validate a complete param group (every key of `GROUP_KEYS`, ``params``); see the module
    docstring. ``where`` prefixes the hyperparameter named in a message, ``context`` the other
    messages (a loaded state dict names the group). Returns the group's `StepLimits`."""
    missing = [k for k in ("params", *GROUP_KEYS) if k not in group]
    if missing:
        raise ValueError(f"{context}keys {missing} are missing (a Muon param group has {list(GROUP_KEYS)})")
    algorithm = group["algorithm"]
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{context}algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    check_hyperparameters(group, where)
    try:
        scale_name(group["adjust_lr_fn"])
        coefficients = group["ns_coefficients"]
        if coefficients is not None and (not isinstance(coefficients, (tuple, list)) or not all(
                isinstance(c, (int, float)) and not isinstance(c, bool) for c in coefficients)):
            raise ValueError(f"ns_coefficients must be None or three numbers (a, b, c), got {coefficients!r}")
        orth = group["orth_dtype"]
        if orth is not None and orth != AUTO and not isinstance(orth, torch.dtype):
            raise ValueError(f"orth_dtype must be 'auto', None (the method's default) or a torch dtype such as "
                             f"torch.bfloat16 or torch.float32, got {orth!r}")
        check_method(group["method"], group["ns_steps"], None if orth == AUTO else orth, coefficients)
        eps = _float(f"{where}eps", group["eps"])
        narrowest = torch.bfloat16 if orth == AUTO else orth  # "auto" may resolve to bfloat16
        if isinstance(narrowest, torch.dtype) and narrowest.is_floating_point and eps > torch.finfo(narrowest).max:
            raise ValueError(f"{where}eps={eps:g} does not fit orth_dtype {orth}")
    except (ValueError, TypeError) as e:
        raise ValueError(f"{context}{e}") from None
    names = group.get("param_names") or [None] * len(group["params"])
    specs = []
    for i, (p, name) in enumerate(zip(group["params"], names)):
        label = f"parameter '{name}'" if name else f"parameter {i} (shape {tuple(p.shape)})"
        if p.is_complex():
            raise TypeError(
                f"{label} is complex; muonclip.Muon optimizes real parameters only (its orthogonalisation and "
                "update scale are defined for real matrices). Keep complex weights in another optimizer, or store "
                "them as real tensors (torch.view_as_real) if a real optimizer is what you want"
            )
        if algorithm == "muon":
            if is_partition(p):  # a wrapper's flat partition of several weights, checked by its driver
                continue
            if p.ndim < 2:
                raise ValueError(
                    f"{label} has shape {tuple(p.shape)}: Muon orthogonalises matrices, so 0-D/1-D "
                    "tensors (biases, norm gains, scalars) must go in an algorithm='adamw' group; "
                    "muonclip.param_groups(model) routes them for you"
                )
            specs.append(matrix_spec(tuple(p.shape), group))
    limits = group_limits(group, specs)
    check_step_scalars(group, limits, where)
    return limits


def check_step_params(group: Mapping[str, Any], where: str = "") -> None:
    """Raise a ValueError naming a parameter of ``group`` on the meta device: it has no data, so
    no step can update it (materialise the model, e.g. ``model.to_empty(device=...)``, and build
    the optimizer over its parameters)."""
    names = group.get("param_names") or [None] * len(group["params"])
    for i, (p, name) in enumerate(zip(group["params"], names)):
        if p.device.type == "meta":
            label = f"parameter '{name}'" if name else f"parameter {i} of {where or 'a param group'} (shape " \
                                                       f"{tuple(p.shape)})"
            raise ValueError(f"{label} is on the meta device: it has no data, so no step can update it. "
                             "Materialise the model first (e.g. model.to_empty(device=...) and its weights' "
                             "initialisation), then build the optimizer over its parameters")


STACKED_CHECK_ELEMENTS = 4096
"""A gradient of at most this many elements is checked with the others of its shape, stacked
(`finite_per_tensor`): one reduction for many small matrices instead of a call each."""


def finite_per_tensor(grads: list[Tensor]) -> Tensor:
    """A bool vector on ``grads[0].device`` (CPU for none): True where that gradient is all
    finite and at most `GRAD_LIMIT` in magnitude. No host sync.

    Exact for every finite input (no overflow): max |g| on CUDA (one fused ``_foreach_norm``
    launch), min and max elsewhere (``aminmax``: torch's CPU ``_foreach_norm(ord=inf)`` is the
    slower one there), those of the gradients of at most `STACKED_CHECK_ELEMENTS` elements per
    stack of same-shape ones (a copy of at most 16 MiB at a time). Both propagate NaN and inf.
    """
    if not grads:
        return torch.ones(0, dtype=torch.bool)
    device = grads[0].device
    if device.type == "cuda":
        stats = torch._foreach_norm(grads, ord=float("inf"))  # max |g|: inf for an inf, NaN for a NaN
        return torch.stack([s.float().to(device, non_blocking=True) for s in stats]) <= GRAD_LIMIT  # NaN, inf: False
    order, ends = [], []  # gradient indices, and their (min, max) as float32 pairs on `device`
    stacked: dict[tuple, list[int]] = {}
    for i, g in enumerate(grads):
        n = g.numel()
        if 0 < n <= STACKED_CHECK_ELEMENTS:
            stacked.setdefault((g.shape, g.dtype, g.device), []).append(i)
        elif n:
            order.append(i)
            ends.append(torch.stack(torch.aminmax(g)).float().to(device, non_blocking=True).view(1, 2))
    for (shape, dtype, _), members in stacked.items():
        run = max(1, 2**22 // (math.prod(shape) * dtype.itemsize))  # at most 16 MiB stacked at a time
        for lo in range(0, len(members), run):
            part = members[lo : lo + run]
            rows = torch.stack([grads[i] for i in part]).view(len(part), -1)
            order += part
            ends.append(torch.stack(torch.aminmax(rows, dim=1), dim=1).float().to(device, non_blocking=True))
    finite = torch.ones(len(grads), dtype=torch.bool, device=device)  # an empty gradient is finite
    if order:
        both = torch.cat(ends)
        finite[torch.tensor(order, device=device)] = (both.abs() <= GRAD_LIMIT).all(dim=1)  # NaN, inf: False
    return finite


def nonfinite_indices(finite: Tensor) -> list[int]:
    """Indices where ``finite`` (from `finite_per_tensor`) is False: one host sync for all."""
    if finite.numel() == 0 or bool(finite.all()):
        return []
    return [i for i, ok in enumerate(finite.tolist()) if not ok]
