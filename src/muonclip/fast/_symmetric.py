"""Symmetric products for Newton–Schulz: compute only the upper triangle of X X^T and S S.

In the quintic step ``S = X X^T``, ``X <- a X + (b S + c S S) X`` both ``S`` and ``S S``
(= ``S S^T``) are symmetric, so half of each product is redundant: a symmetric kernel needs
about ``3 m^2 n + m^3`` flops a step instead of ``4 m^2 n + 2 m^3`` (docs/design.md, "Faster
variants of the quintic").

Without a symmetric (syrk) kernel for bf16 we cut the rows into ``blocks`` strips of height h
and compute strip i against rows ``i h ..`` only (``X_i @ X[i h:]^T``: a (h, m - i h) block
of the upper triangle), then mirror it into the lower triangle. That costs
``(blocks + 1) / (2 blocks)`` of the full product's flops (0.75 for 2 strips, 0.625 for 4),
in ``blocks`` smaller matrix products and one mirror copy per strip.

On the CPUs we measured (docs/benchmarks.md) the strips run at a lower rate than one big product
and the mirror copies cost more than the saved flops, so ``ns5_sym`` is slower than plain ns5
at the GPT and expert shapes. It is a method of its own (``method="ns5_sym"``), never a default.

On a CUDA device with Triton, both symmetric products run in the Triton kernel of
`muonclip.fast._triton_syrk` instead (upper-triangle tiles only, ``P = b S + c S S`` fused into
its epilogue); the product with X stays with cuBLAS.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..common import defaults as D
from ..ortho._newton_schulz import normalized, quintic
from ..ortho._precision import auto_dtype
from ._triton_syrk import syrk, usable

SYM_BLOCKS = 2


def sym_gram(X: Tensor, blocks: int = SYM_BLOCKS) -> Tensor:  # X: (batch, m, n)
    """``X X^T`` (batch, m, m) from its upper-triangle row strips; exact up to round-off.

    ``blocks`` strips (default 2; 1 means one plain product). Rows are split as evenly as
    possible when m is not a multiple of ``blocks``.
    """
    batch, m, n = X.shape
    if blocks <= 1 or m < 2 * blocks:
        return torch.bmm(X, X.mT)
    bounds = [round(i * m / blocks) for i in range(blocks + 1)]
    S = X.new_empty(batch, m, m)
    for i in range(blocks):
        r0, r1 = bounds[i], bounds[i + 1]
        strip = torch.bmm(X[:, r0:r1], X[:, r0:].mT)  # (batch, h, m - r0): rows r0:r1, cols r0:
        S[:, r0:r1, r0:] = strip
        if r1 < m:
            S[:, r1:, r0:r1] = strip[:, :, r1 - r0 :].mT
    return S


def symmetric_quintic(
    X: Tensor,  # (batch, p, q), wide or tall, normalised so that ||X||_2 <= 1
    coefficients: Sequence[tuple[float, float, float]],
    blocks: int = SYM_BLOCKS,
) -> Tensor:
    """`muonclip.ortho._newton_schulz.quintic` (the one quintic iteration) with its two symmetric
    products, ``X X^T`` and ``b S + c S S``, from `sym_gram` (of ``X^T`` for a tall X), or, where
    `muonclip.fast._triton_syrk.usable` (CUDA and Triton), from its kernel with ``b S + c S S`` in
    one rounding; returns a new tensor of X's shape."""
    kernel = usable(X)

    def gram_of(X: Tensor, out: None = None) -> Tensor:  # S = X X^T (X^T X for a tall X)
        G = X.mT if X.shape[-2] > X.shape[-1] else X
        return syrk(G) if kernel else sym_gram(G, blocks)

    def poly_of(S: Tensor, b: float, c: float, out: None = None) -> Tensor:  # b S + c S S
        return syrk(S, alpha=c, beta=b, add=S) if kernel else sym_gram(S, blocks).mul_(c).add_(S, alpha=b)

    return quintic(X, coefficients, gram_of=gram_of, poly_of=poly_of)


def symmetric_newton_schulz(
    V: Tensor,  # (..., A, B)
    coefficients: Sequence[tuple[float, float, float]],
    *,
    dtype: torch.dtype | str = D.ORTH_DTYPE,
    eps: float = D.EPS,
    norm_scale: float = 1.0,
    blocks: int = SYM_BLOCKS,
) -> Tensor:
    """`muonclip.ortho.newton_schulz` with the symmetric products of `sym_gram`
    (``method="ns5_sym"``): the same arguments and result (a new tensor of ``V``'s shape, in
    ``dtype``); ``blocks`` row strips per symmetric product (default 2)."""
    dtype = auto_dtype(V.device) if dtype == D.AUTO else dtype
    return symmetric_quintic(normalized(V, dtype, eps, norm_scale), coefficients, blocks).reshape(V.shape)
