"""Orthogonalisation: map each matrix V to (approximately) its polar factor U V^T.

The core's orthogonalisers are pure functions (a batch in, a new tensor out; nothing kept, the
input never written): `newton_schulz` (``"ns5"``, ``"polar_express"``), `gram_newton_schulz`
(``"gram"``) and `svd_polar` (``"svd"``, the exact reference every method is tested against).
`orthogonalize` dispatches to a method by name through the registry `METHODS`;
`register_method` adds one (`muonclip.fast` registers ``"ns5_sym"`` and ``"ns5_compiled"``).
Their defaults are every caller's (`muonclip.common.defaults`); the compute dtype's,
``"auto"``, is resolved per device by `resolve_orth_dtype` (`muonclip.ortho._precision`).
See docs/design.md, "Orthogonalisation".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..common.defaults import AUTO, EPS, METHOD, NS_COEFFICIENTS, NS_STEPS, ORTH_DTYPE
from ._gram import gram_newton_schulz
from ._newton_schulz import (
    NS5_COEFFICIENTS,
    POLAR_EXPRESS_SAFETY,
    Scratch,
    newton_schulz,
    no_scratch,
    polar_express_coefficients,
)
from ._precision import auto_dtype
from ._svd import svd_polar


@dataclass(frozen=True)
class Method:
    """An orthogonalisation method.

    Attributes:
        run: ``run(V, steps, dtype, eps, coefficients) -> Tensor``: the polar factors of the
            ``(..., A, B)`` batch ``V``, a new tensor of its shape in ``dtype``; with
            ``in_place``, also ``run(..., out=, scratch=)``: the result into ``out``
            (``(batch, A, B)``), ``V`` normalised in place, the temporaries in ``scratch``
            (`muonclip.ortho._newton_schulz.Scratch`), the same products on the same values.
        default_steps: iterations used when ``steps`` is None (0 for direct methods).
        default_dtype: compute dtype used when ``dtype`` is None (and for ``"auto"`` when the
            method has no bfloat16).
        dtypes: compute dtypes the method accepts.
        takes_coefficients: whether ``coefficients`` (the quintic's (a, b, c)) applies
            (default False: passing them is an error).
        in_place: whether ``run`` takes ``out`` and ``scratch`` (default False).
    """

    run: Callable[..., Tensor]
    default_steps: int
    default_dtype: torch.dtype
    dtypes: tuple[torch.dtype, ...]
    takes_coefficients: bool = False
    in_place: bool = False


def ns5_schedule(steps: int, coefficients: Sequence[float] | None) -> list[tuple[float, float, float]]:
    """The quintic's (a, b, c) for each of ``steps`` steps: ``coefficients`` or Keller Jordan's."""
    return [tuple(coefficients or NS5_COEFFICIENTS)] * steps  # type: ignore[list-item]


def _ns5(V: Tensor, steps: int, dtype: torch.dtype, eps: float, coefficients: Sequence[float] | None,
         out: Tensor | None = None, scratch: Scratch = no_scratch) -> Tensor:
    return newton_schulz(V, ns5_schedule(steps, coefficients), dtype=dtype, eps=eps, out=out, scratch=scratch)


def _polar_express(V: Tensor, steps: int, dtype: torch.dtype, eps: float, coefficients: None,
                   out: Tensor | None = None, scratch: Scratch = no_scratch) -> Tensor:
    return newton_schulz(V, polar_express_coefficients(steps), dtype=dtype, eps=eps, norm_scale=POLAR_EXPRESS_SAFETY,
                         out=out, scratch=scratch)


def _gram(V: Tensor, steps: int, dtype: torch.dtype, eps: float, coefficients: Sequence[float] | None,
          out: Tensor | None = None, scratch: Scratch = no_scratch) -> Tensor:
    return gram_newton_schulz(V, ns5_schedule(steps, coefficients), dtype=dtype, eps=eps, out=out, scratch=scratch)


def _svd(V: Tensor, steps: int, dtype: torch.dtype, eps: float, coefficients: None) -> Tensor:
    return svd_polar(V, dtype=dtype)


ITERATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

METHODS: dict[str, Method] = {
    "ns5": Method(_ns5, 5, torch.bfloat16, ITERATIVE_DTYPES, takes_coefficients=True, in_place=True),
    "polar_express": Method(_polar_express, 5, torch.bfloat16, ITERATIVE_DTYPES, in_place=True),
    "gram": Method(_gram, 5, torch.bfloat16, ITERATIVE_DTYPES, takes_coefficients=True, in_place=True),
    "svd": Method(_svd, 0, torch.float64, (torch.float32, torch.float64)),
}


def register_method(name: str, method: Method) -> None:
    """Make ``method`` available as ``orthogonalize(V, name)`` and ``Muon(method=name)``.

    Raises ValueError if ``name`` is taken by another method (registering the same one again
    is a no-op).
    """
    if METHODS.get(name, method) != method:
        raise ValueError(f"an orthogonalisation method named {name!r} is already registered")
    METHODS[name] = method


def check_method(method: str, steps: int | None, dtype: torch.dtype | str | None,
                 coefficients: Sequence[float] | None = NS_COEFFICIENTS) -> Method:
    """Validate a (method, steps, dtype, coefficients) choice and return the method; raise ValueError if bad.

    ``dtype`` is a dtype the method computes in, None (its default) or ``"auto"``."""
    if method not in METHODS:
        raise ValueError(f"unknown orthogonalisation method {method!r}; choose one of {sorted(METHODS)}")
    m = METHODS[method]
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1 or steps >= 100):
        raise ValueError(f"steps must be an int in [1, 100) or None for the default, got {steps!r}")
    if dtype is not None and dtype != AUTO and dtype not in m.dtypes:
        raise ValueError(f"method {method!r} computes in one of {m.dtypes}, 'auto' or None (its default), "
                         f"got dtype={dtype!r}")
    if coefficients is not None:
        if not m.takes_coefficients:
            takers = sorted(k for k, v in METHODS.items() if v.takes_coefficients)
            raise ValueError(f"method {method!r} has no quintic coefficients to set; coefficients apply to {takers}")
        if len(coefficients) != 3 or not all(math.isfinite(c) for c in coefficients):
            raise ValueError(
                f"coefficients is the quintic's triple (a, b, c) of finite numbers, got {tuple(coefficients)}"
            )
    return m


def check_input(V: Tensor, eps: float) -> None:
    """Raise unless ``V`` is a real floating-point matrix or batch and ``eps`` a finite number > 0
    (nothing is read from ``V``'s values: see `orthogonalize` for the finiteness check).

    Raises:
        ValueError: ``V`` has fewer than 2 dimensions; ``eps`` is not a finite number > 0.
        TypeError: ``V`` is complex, integer or boolean.
    """
    if V.ndim < 2:
        raise ValueError(f"orthogonalize needs a matrix or a batch of matrices, got shape {tuple(V.shape)}")
    if V.is_complex():
        raise TypeError("orthogonalize works on real matrices; got a complex tensor")
    if not V.dtype.is_floating_point:
        raise TypeError(f"orthogonalize works on floating-point matrices, got {V.dtype}; convert first (V.float())")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite number > 0 (it keeps a zero matrix from dividing by zero), got {eps!r}")


def resolve_orth_dtype(orth_dtype: torch.dtype | str | None, method: str, device: torch.device | str) -> torch.dtype:
    """The dtype ``method`` computes in on ``device`` when asked for ``orth_dtype``: the dtype
    itself, the method's default for None, and for ``"auto"`` bfloat16 where the device multiplies
    it natively, else float32 (`muonclip.ortho._precision`; the method's default when it has no
    bfloat16)."""
    m = METHODS[method]
    if orth_dtype is None:
        return m.default_dtype
    if orth_dtype != AUTO:
        return orth_dtype
    return auto_dtype(device) if torch.bfloat16 in m.dtypes else m.default_dtype


def run_method(
    V: Tensor,
    method: str = METHOD,
    steps: int | None = NS_STEPS,
    dtype: torch.dtype | str | None = ORTH_DTYPE,
    *,
    eps: float = EPS,
    coefficients: Sequence[float] | None = NS_COEFFICIENTS,
) -> Tensor:
    """`orthogonalize` without the look at ``V``'s values: the same arguments, checks (`check_method`,
    `check_input`) and result, for a caller that guarantees finite input (``muonclip.Muon``'s step
    refuses non-finite and overflowing gradients first), so that no pass over ``V`` and no host
    sync is added. A non-finite ``V`` gives a non-finite result here."""
    m = check_method(method, steps, dtype, coefficients)
    check_input(V, eps)
    if V.numel() == 0:
        return V.clone()
    steps = m.default_steps if steps is None else steps
    return m.run(V, steps, resolve_orth_dtype(dtype, method, V.device), eps, coefficients).to(V.dtype)


def orthogonalize(
    V: Tensor,
    method: str = METHOD,
    steps: int | None = NS_STEPS,
    dtype: torch.dtype | str | None = ORTH_DTYPE,
    *,
    eps: float = EPS,
    coefficients: Sequence[float] | None = NS_COEFFICIENTS,
) -> Tensor:
    """Approximate the polar factor ``U V^T`` of every matrix in ``V``.

    Every method first scales each matrix by a power of two when its entries are so large that
    the sum of their squares would overflow (`muonclip.ortho._newton_schulz.overflow_scale`; exact,
    and a no-op otherwise), so any finite input gives a finite result, up to float32's largest
    values.

    Args:
        V: a matrix ``(A, B)`` or a batch ``(..., A, B)``; tall or wide; floating point and finite
            (checked: one pass over ``V`` and one host sync; `run_method` skips it). Never written.
        method: ``"ns5"`` (Keller Jordan's quintic Newton–Schulz, default; singular values
            end in about [0.68, 1.13]), ``"polar_express"`` (Amsel et al. 2025, minimax
            per-step coefficients; |sigma - 1| < 0.01 after 6 steps in fp32), ``"svd"`` (exact,
            the reference), ``"gram"`` (ns5's polynomial run on the small Gram matrix, with one
            restart: 0.67x the flops at 384 x 1536, same band as ns5 in bf16; see
            `muonclip.ortho._gram`), or any name registered with `register_method`
            (`muonclip.fast` adds ``"ns5_sym"`` and ``"ns5_compiled"``).
        steps: iterations; None picks the method's default (5 for the iterative methods).
        dtype: compute dtype: ``"auto"`` (default, `muonclip.Muon`'s too): bfloat16 where
            ``V``'s device multiplies it natively, else float32 (float64 for svd); None: the
            method's own default on every device (bfloat16 for the iterations, float64 for
            svd); or a dtype the method computes in.
        eps: added to the Frobenius norm before normalising, a finite number > 0 (default 1e-7),
            so a zero matrix gives zeros, never NaN.
        coefficients: the quintic's (a, b, c) for the methods that run it (ns5, gram and the
            registered ones that say so; default None: (3.4445, -4.7750, 2.0315)).

    Returns:
        A new tensor of ``V``'s shape and dtype.

    Raises:
        ValueError: ``V`` holds NaN or inf, has fewer than 2 dimensions, ``eps`` is not > 0, or
            a bad method, steps, dtype or coefficients (`check_method`).
        TypeError: ``V`` is complex, integer or boolean.

    References:
        K. Jordan et al., "Muon: An optimizer for hidden layers" (2024).
        N. Amsel et al., "The Polar Express", arXiv 2505.16932.
    """
    check_method(method, steps, dtype, coefficients)
    check_input(V, eps)
    if V.numel() and not bool(torch.isfinite(torch.stack(torch.aminmax(V))).all()):  # NaN propagates; fast on CPU
        raise ValueError("orthogonalize needs finite matrices: V holds NaN or inf (its polar factor is undefined)")
    return run_method(V, method, steps, dtype, eps=eps, coefficients=coefficients)


__all__ = [
    "METHODS", "Method", "check_input", "check_method", "newton_schulz", "ns5_schedule", "orthogonalize",
    "polar_express_coefficients", "register_method", "resolve_orth_dtype", "run_method", "svd_polar",
]
