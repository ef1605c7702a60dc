"""Newton–Schulz iterations that map a matrix to (approximately) its polar factor U V^T.

Two coefficient schedules share one iteration (docs/design.md, "Orthogonalisation"):

* ``ns5`` — Keller Jordan's quintic, one fixed (a, b, c) = (3.4445, -4.7750, 2.0315) for every
  step. Fast, deliberately inexact: singular values land in about [0.68, 1.13].
* ``polar_express`` — Amsel et al., "The Polar Express" (arXiv 2505.16932): a minimax-optimal
  (a, b, c) per step; 5–6 steps bring every singular value within 0.01 of 1.

A batch ``V`` of shape ``(..., A, B)`` in, a new tensor of that shape out; no buffer is kept and
the input is never written, unless the caller passes storage (``out``, ``scratch``: what
`muonclip.fast._buffered` does with buffers kept between optimizer steps; the same
products into other storage).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..common.defaults import AUTO, EPS, ORTH_DTYPE
from ._precision import auto_dtype

NS5_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)

# Polar Express coefficients for degree-5 polynomials, as published (before the bf16 safety
# division that `polar_express_coefficients` applies to every step but the last).
_POLAR_EXPRESS_RAW: tuple[tuple[float, float, float], ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
POLAR_EXPRESS_SAFETY = 1.01


def polar_express_coefficients(steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) of each of ``steps`` Polar Express iterations.

    Each published triple but the last is divided by (1.01, 1.01**3, 1.01**5), which keeps
    bf16 round-off from pushing singular values past the polynomial's fixed point; the last
    triple (1.875, -1.25, 0.375) is used undivided and repeated for steps beyond the table.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    s = POLAR_EXPRESS_SAFETY
    table = [(a / s, b / s**3, c / s**5) for a, b, c in _POLAR_EXPRESS_RAW[:-1]]
    table.append(_POLAR_EXPRESS_RAW[-1])
    return [table[min(i, len(table) - 1)] for i in range(steps)]


def gram(X: Tensor, out: Tensor | None = None) -> Tensor:  # X: (batch, p, q)
    """The small Gram matrix ``(batch, m, m)``, m = min(p, q): ``X X^T`` for a wide or square X,
    ``X^T X`` for a tall one (into ``out`` if given)."""
    return torch.bmm(X.mT, X, out=out) if X.shape[-2] > X.shape[-1] else torch.bmm(X, X.mT, out=out)


def small_side(P: Tensor, X: Tensor, beta: float | None = None, out: Tensor | None = None) -> Tensor:
    """``P`` (batch, m, m), symmetric, applied to ``X`` on its small side: ``P X`` for a wide or
    square X, ``X P`` for a tall one (the transpose of ``P X^T``); with ``beta``, ``beta X`` is
    added in the same product (one rounding). Into ``out`` if given."""
    tall = X.shape[-2] > X.shape[-1]
    left, right = (X, P) if tall else (P, X)
    if beta is None:
        return torch.bmm(left, right, out=out)
    return torch.baddbmm(X, left, right, beta=beta, out=out)


def overflow_scale(X: Tensor) -> Tensor:  # X: (batch, A, B)
    """Per matrix of the batch ``X``, the power of two ``2^-k`` (``k >= 0``, shape ``(batch, 1, 1)``)
    that keeps its Frobenius norm from overflowing: the largest ``|x|`` (``||X_i||_max``, which
    squares nothing) scaled below ``2^E``, ``E = (maxexp - 1 - ceil(log2(A B))) // 2`` of X's dtype,
    so that no square and no sum of ``A B`` squares exceeds the dtype's range (float32 and
    bfloat16: ``E`` = 53 at 384 x 1536). It is 1 for every matrix already below, the usual case,
    and a power of two changes no mantissa: ``X * overflow_scale(X)`` is X bit for bit there, and
    exactly X scaled elsewhere (the polar factor does not depend on the scale)."""
    A, B = X.shape[-2:]
    maxexp = math.frexp(torch.finfo(X.dtype).max)[1]  # the dtype's largest value is below 2^maxexp
    E = (maxexp - 1 - math.ceil(math.log2(max(1, A * B)))) // 2
    # max |x| as the larger of max x and -min x: the same value exactly as vector_norm(ord=inf),
    # whose CPU kernel is 4 to 8 times slower than these two reductions
    amax = torch.maximum(X.amax(dim=(-2, -1), keepdim=True), X.amin(dim=(-2, -1), keepdim=True).neg())
    _, exponent = torch.frexp(amax)  # amax < 2^exponent
    return torch.ldexp(torch.ones_like(amax), (E - exponent).clamp(max=0))


Scratch = Callable[..., "Tensor | None"]
"""Where an iteration's temporaries may live: ``scratch(role, shape, dtype, device, avoid=None)``
returns a tensor of that shape to overwrite (not sharing storage with ``avoid``), or None for a
new one (e.g. `muonclip.fast._buffered.Buffers.get`: buffers kept between optimizer steps)."""


def no_scratch(role: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
               avoid: Tensor | None = None) -> None:
    """The `Scratch` that keeps nothing: every temporary is a new tensor."""
    return None


def poly(S: Tensor, b: float, c: float, out: Tensor | None = None) -> Tensor:
    """``b S + c S S`` for a symmetric batch ``S``, in one product and one rounding (into ``out``)."""
    return torch.baddbmm(S, S, S, beta=b, alpha=c, out=out)


def normalized(V: Tensor, dtype: torch.dtype, eps: float, norm_scale: float = 1.0, inplace: bool = False) -> Tensor:
    """``V`` as a batch ``(batch, A, B)`` in ``dtype``, each matrix scaled by `overflow_scale` (a
    power of two, 1 unless its entries are huge) and then divided by ``||X_i||_F * norm_scale +
    eps`` (so its spectral norm is at most 1; a zero matrix stays zero; a finite matrix never
    gives inf or NaN, however large its entries). ``inplace``: in ``V``'s own storage when ``V``
    is in ``dtype`` and contiguous (the same values, no copy)."""
    X = V.reshape(-1, *V.shape[-2:]).to(dtype)
    if inplace:
        X.mul_(overflow_scale(X))
        return X.div_(torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) * norm_scale + eps)
    X = X * overflow_scale(X)
    return X / (torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) * norm_scale + eps)


def quintic(X: Tensor, coefficients: Sequence[tuple[float, float, float]], *, out: Tensor | None = None,
            scratch: Scratch = no_scratch, gram_of: Callable[..., Tensor] = gram,
            poly_of: Callable[..., Tensor] = poly) -> Tensor:
    """The quintic iteration: one step ``X <- a X + (b S + c S S) X`` with ``S = X X^T`` per (a, b, c),
    on a normalised batch ``(batch, p, q)``; a tall X runs the transposed form ``X <- a X + X (b S
    + c S S)``, ``S = X^T X`` (`gram`, `small_side`), so every product is on the small side and
    nothing is copied into a transposed layout. ``4 m^2 n + 2 m^3`` flops a step, m <= n the sides.

    This is the one definition every quintic method runs (``ns5``, ``polar_express``, ``gram`` on
    squarish matrices, the buffered workspace, ``ns5_sym``, ``ns5_compiled``); they differ only in
    where the tensors live and how the two symmetric products are computed:

    * ``out`` (X's shape, not overlapping X): the result is written there and X is overwritten:
      the steps alternate between ``out`` and X (free once step 0 has read it), so the call
      touches two X-sized tensors besides S and P; only step 0 of an even number of steps takes
      a third (``"ns.X"``). None (default): each step's X is a new tensor and X is not written.
    * ``scratch`` (`Scratch`): storage for S, P (``"ns.S"``, ``"ns.P"``) and that third X.
    * ``gram_of(X, out=None)``: ``S`` (default `gram`); ``poly_of(S, b, c, out=None)``: ``b S +
      c S S`` (default `poly`). `muonclip.fast._symmetric` computes both from their upper
      triangles.
    """
    last = len(coefficients) - 1
    dtype, device, small = X.dtype, X.device, (X.shape[0], *[min(X.shape[-2:])] * 2)
    spare = X
    for i, (a, b, c) in enumerate(coefficients):
        S = gram_of(X, out=scratch("ns.S", small, dtype, device))  # (batch, m, m)
        P = poly_of(S, b, c, out=scratch("ns.P", small, dtype, device))  # b S + c S S
        if out is None:
            nxt = None
        elif (last - i) % 2 == 0:
            nxt = out
        else:
            nxt = spare if i > 0 else scratch("ns.X", X.shape, dtype, device)
        X = small_side(P, X, beta=a, out=nxt)  # a X + P X, one rounding
    return X


def ns_flops(blocks: Sequence[tuple[int, int, int]], steps: int) -> int:
    """Flops of ``steps`` quintic Newton–Schulz iterations on matrix blocks ``(E, A, B)``.

    Per matrix, with ``m = min(A, B)``, ``n = max(A, B)``: one step costs ``4 m^2 n + 2 m^3``
    (``X X^T``: ``2 m^2 n``; ``S S``: ``2 m^3``; ``P X``: ``2 m^2 n``).
    """
    total = 0
    for E, A, B in blocks:
        m, n = min(A, B), max(A, B)
        total += E * steps * (4 * m * m * n + 2 * m**3)
    return total


def newton_schulz(
    V: Tensor,  # (..., A, B)
    coefficients: Sequence[tuple[float, float, float]],
    *,
    dtype: torch.dtype | str = ORTH_DTYPE,
    eps: float = EPS,
    norm_scale: float = 1.0,
    out: Tensor | None = None,
    scratch: Scratch = no_scratch,
) -> Tensor:
    """Approximate the polar factor of each matrix in ``V`` by a quintic Newton–Schulz run.

    Algorithm (per matrix): cast to ``dtype``; scale by a power of two if its entries are so large
    that the sum of their squares would overflow (`overflow_scale`, exact); divide by
    ``||X||_F * norm_scale + eps`` (a zero matrix stays zero, never NaN); run one quintic step per
    triple in ``coefficients`` on the small Gram matrix's side (`quintic`).

    Args:
        V: matrices of shape ``(..., A, B)``; leading dimensions are a batch.
        coefficients: one (a, b, c) per step.
        dtype: compute dtype (default ``"auto"``: bfloat16 where ``V``'s device multiplies it
            natively, else float32; `muonclip.ortho._precision`).
        eps: added to the Frobenius norm before the division (default 1e-7).
        norm_scale: the Frobenius norm is multiplied by this first (default 1.0; Polar Express
            uses 1.01).
        out: ``(batch, A, B)`` storage for the result (default None: a new tensor); given, ``V``
            is normalised in place and overwritten when it is in ``dtype`` (`quintic`).
        scratch: storage for the temporaries (`Scratch`; default: new tensors).

    Returns:
        The result, of ``V``'s shape, in ``dtype`` (in ``out`` when given).
    """
    dtype = auto_dtype(V.device) if dtype == AUTO else dtype
    X = normalized(V, dtype, eps, norm_scale, inplace=out is not None)
    return quintic(X, coefficients, out=out, scratch=scratch).reshape(V.shape)
