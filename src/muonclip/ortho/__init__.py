"""Orthogonalisation: map each matrix V to (approximately) its polar factor U V^T.

`orthogonalize` dispatches to a method by name; `METHODS` is the registry, and every method
is tested against the exact SVD polar factor (`svd_polar`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .compiled import compiled_newton_schulz
from .gram import gram_newton_schulz
from .newton_schulz import (
    NS5_COEFFICIENTS,
    POLAR_EXPRESS_SAFETY,
    newton_schulz,
    polar_express_coefficients,
)
from .svd import svd_polar
from .symmetric import symmetric_newton_schulz


@dataclass(frozen=True)
class Method:
    """An orthogonalisation method.

    Attributes:
        run: ``run(V, steps, dtype, eps, coefficients) -> Tensor`` on ``(..., A, B)`` input.
        default_steps: iterations used when ``steps`` is None (0 for direct methods).
        default_dtype: compute dtype used when ``dtype`` is None.
        dtypes: compute dtypes the method accepts.
        takes_coefficients: whether ``coefficients`` (the quintic's (a, b, c)) applies
            (default False: passing them is an error).
        takes_buffer: whether ``run`` also takes ``buffer=``, ``scratch=`` and ``overwrite=``
            (storage for its result and its temporaries, and leave to overwrite its input; see
            `orthogonalize`; default False: never passed them).
    """

    run: Callable[..., Tensor]
    default_steps: int
    default_dtype: torch.dtype
    dtypes: tuple[torch.dtype, ...]
    takes_coefficients: bool = False
    takes_buffer: bool = False


def _ns5(V, steps, dtype, eps, coefficients, buffer=None, scratch=None, overwrite=False):
    coeffs = [tuple(coefficients or NS5_COEFFICIENTS)] * steps
    return newton_schulz(V, coeffs, dtype=dtype, eps=eps, buffer=buffer, scratch=scratch, overwrite=overwrite)


def _polar_express(V, steps, dtype, eps, coefficients, buffer=None, scratch=None, overwrite=False):
    coeffs = polar_express_coefficients(steps)
    return newton_schulz(V, coeffs, dtype=dtype, eps=eps, norm_scale=POLAR_EXPRESS_SAFETY, buffer=buffer,
                         scratch=scratch, overwrite=overwrite)


def _gram(V, steps, dtype, eps, coefficients, buffer=None, scratch=None, overwrite=False):
    coeffs = [tuple(coefficients or NS5_COEFFICIENTS)] * steps
    return gram_newton_schulz(V, coeffs, dtype=dtype, eps=eps, buffer=buffer, scratch=scratch, overwrite=overwrite)


def _ns5_compiled(V, steps, dtype, eps, coefficients):
    coeffs = [tuple(coefficients or NS5_COEFFICIENTS)] * steps
    return compiled_newton_schulz(V, coeffs, dtype=dtype, eps=eps)


def _ns5_sym(V, steps, dtype, eps, coefficients, buffer=None, scratch=None, overwrite=False):
    coeffs = [tuple(coefficients or NS5_COEFFICIENTS)] * steps
    return symmetric_newton_schulz(V, coeffs, dtype=dtype, eps=eps, buffer=buffer, scratch=scratch, overwrite=overwrite)


def _svd(V, steps, dtype, eps, coefficients):
    return svd_polar(V, dtype=dtype)


_ITERATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

METHODS: dict[str, Method] = {
    "ns5": Method(_ns5, 5, torch.bfloat16, _ITERATIVE_DTYPES, takes_coefficients=True, takes_buffer=True),
    "polar_express": Method(_polar_express, 5, torch.bfloat16, _ITERATIVE_DTYPES, takes_buffer=True),
    "svd": Method(_svd, 0, torch.float64, (torch.float32, torch.float64)),
    "gram": Method(_gram, 5, torch.bfloat16, _ITERATIVE_DTYPES, takes_coefficients=True, takes_buffer=True),
    "ns5_sym": Method(_ns5_sym, 5, torch.bfloat16, _ITERATIVE_DTYPES, takes_coefficients=True, takes_buffer=True),
    "ns5_compiled": Method(_ns5_compiled, 5, torch.bfloat16, _ITERATIVE_DTYPES, takes_coefficients=True),
}


def check_method(
    method: str, steps: int | None, dtype: torch.dtype | None, coefficients: Sequence[float] | None = None
) -> Method:
    """Validate a (method, steps, dtype, coefficients) choice and return the method; raise ValueError if bad."""
    if method not in METHODS:
        raise ValueError(f"unknown orthogonalisation method {method!r}; choose one of {sorted(METHODS)}")
    m = METHODS[method]
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1 or steps >= 100):
        raise ValueError(f"steps must be an int in [1, 100) or None for the default, got {steps!r}")
    if dtype is not None and dtype not in m.dtypes:
        raise ValueError(f"method {method!r} computes in one of {m.dtypes}, got dtype={dtype}")
    if coefficients is not None:
        if not m.takes_coefficients:
            takers = sorted(k for k, v in METHODS.items() if v.takes_coefficients)
            raise ValueError(f"method {method!r} has no quintic coefficients to set; coefficients apply to {takers}")
        if len(coefficients) != 3 or not all(math.isfinite(c) for c in coefficients):
            raise ValueError(
                f"coefficients is the quintic's triple (a, b, c) of finite numbers, got {tuple(coefficients)}"
            )
    return m


def orthogonalize(
    V: Tensor,
    method: str = "ns5",
    steps: int | None = None,
    dtype: torch.dtype | None = None,
    *,
    eps: float = 1e-7,
    coefficients: Sequence[float] | None = None,
    out_dtype: torch.dtype | None = None,
    buffer: Tensor | None = None,
    scratch: dict | None = None,
    overwrite: bool = False,
) -> Tensor:
    """Approximate the polar factor ``U V^T`` of every matrix in ``V``.

    Args:
        V: a matrix ``(A, B)`` or a batch ``(..., A, B)``; tall or wide. Must be finite.
        method: ``"ns5"`` (Keller Jordan's quintic Newton–Schulz, default; singular values
            end in about [0.68, 1.13]), ``"polar_express"`` (Amsel et al. 2025, minimax
            per-step coefficients; |sigma - 1| < 0.01 after 6 steps in fp32), ``"svd"`` (exact,
            the reference), ``"gram"`` (ns5's polynomial run on the small Gram matrix, with one
            restart: 0.67x the flops at 384 x 1536, same band as ns5 in bf16; see
            `muonclip.ortho.gram`), ``"ns5_sym"`` (ns5 computing only half of the symmetric
            products: row strips on CPU, a Triton kernel on CUDA; see
            `muonclip.ortho.symmetric` and `muonclip.ortho.triton_syrk`), ``"ns5_compiled"`` (ns5 through
            ``torch.compile``; see `muonclip.ortho.compiled`), or any other name registered in
            ``muonclip.ortho.METHODS``.
        steps: iterations; None picks the method's default (5 for ns5 and polar_express).
        dtype: compute dtype; None picks the method's default (bf16 for the iterations,
            float64 for svd).
        eps: added to the Frobenius norm before normalising (default 1e-7), so a zero matrix
            gives zeros, never NaN.
        coefficients: ns5, gram, ns5_sym and ns5_compiled only: the quintic's (a, b, c) (default
            (3.4445, -4.7750, 2.0315)).
        out_dtype: dtype of the result (default None: ``V``'s dtype). Pass the compute dtype
            to skip the final cast when the caller casts anyway (Muon adds the bf16 result
            straight into the weight).
        buffer: storage for the result (default None: a new tensor), for a caller that
            orthogonalises every step and wants to reuse one: a contiguous tensor in the
            compute dtype, on ``V``'s device, with at least ``V.numel()`` elements, not
            overlapping ``V``. When the method can write there (``Method.takes_buffer``: ns5,
            polar_express, gram, ns5_sym) and ``out_dtype`` is the compute dtype, the result
            is a view of it, valid until the buffer is reused; otherwise it is ignored.
        scratch: a dict the caller keeps between calls (default None: none), where the
            methods that take ``buffer`` keep their temporaries on CPU instead of allocating
            them each call (`muonclip.ortho.scratch`: fresh multi-MB temporaries are page-faulted
            in on every call). It grows to 2–5 times the largest batch's size.
        overwrite: whether ``V`` may be overwritten (default False: it is left as it was),
            for a caller that discards its input: the methods that take ``buffer`` then
            normalise ``V`` in place and use it as a working buffer (one matrix-sized buffer
            less; `muonclip.Muon` hands its bucket over this way). ``V``'s contents afterwards
            are unspecified.

    Returns:
        A tensor of ``V``'s shape, in ``out_dtype`` (default ``V``'s dtype).

    References:
        K. Jordan et al., "Muon: An optimizer for hidden layers" (2024).
        N. Amsel et al., "The Polar Express", arXiv 2505.16932.
    """
    m = check_method(method, steps, dtype, coefficients)
    if V.ndim < 2:
        raise ValueError(f"orthogonalize needs a matrix or a batch of matrices, got shape {tuple(V.shape)}")
    if V.is_complex():
        raise TypeError("orthogonalize works on real matrices; got a complex tensor")
    if V.numel() == 0:
        return V.to(out_dtype or V.dtype, copy=True)
    dtype = dtype or m.default_dtype
    steps = m.default_steps if steps is None else steps
    extra = {"scratch": scratch, "overwrite": overwrite} if m.takes_buffer else {}
    if buffer is not None and m.takes_buffer and (out_dtype or V.dtype) == dtype:
        return m.run(V, steps, dtype, eps, coefficients, buffer=buffer, **extra)
    return m.run(V, steps, dtype, eps, coefficients, **extra).to(out_dtype or V.dtype)


__all__ = ["METHODS", "Method", "check_method", "orthogonalize", "svd_polar", "newton_schulz"]
