"""Gram Newton–Schulz: the quintic iteration run on the small m x m Gram matrix.

For a wide matrix X (m x n, m < n) every quintic step is ``X <- (a I + b S + c S^2) X`` with
``S = X X^T``. Each step multiplies X on the left by a polynomial in the Gram matrix, so
``X_k = Q_k X_0`` where Q_k is an m x m matrix, and everything but the first ``X X^T`` and the
last ``Q X`` can be done on m x m matrices (Dao-AILab's "Gram Newton–Schulz", 2026). With
``R = X_k X_k^T`` and ``Z = b R + c R^2`` one step is::

    Q <- Q (a I + Z)                        # (first step: Q = a I + Z)
    R <- (a I + Z) R (a I + Z)              # = a (a R + R Z) + Z (a R + R Z)

All of Q, R and Z are polynomials in the first Gram matrix, so they commute and stay
symmetric. In exact arithmetic the result equals the plain quintic's.

**Restarts.** In low precision R drifts: its eigenvectors stop matching X's and round-off
creates spurious negative eigenvalues, which the polynomial then blows up. A *restart* before
step i forms ``X = Q X`` and ``R = X X^T`` afresh (costing two m x n products). Dao-AILab
restart once, before step 2 of 5, computing in fp16. In bf16 (8-bit mantissa; CPUs have no fast
fp16 matmul) we measured, on 6 matrices 384 x 1536 with singular values
log-spaced in [0.01, 1] (max |sigma - 1|; plain bf16 quintic / float64 quintic in brackets):
ns5 5 steps: no restart 1.26, restart (2,) 0.40, (3,) 0.325 [0.320 / 0.318];
Over 24 cases (48 x 192 to 384 x 1536, singular values down to 1e-3, 2 seeds) the worst
excess of max |sigma - 1| over the plain bf16 quintic was, for ns5: (2,) 0.145, (3,) 0.017,
(1, 3) 0.009; for Polar Express 5 steps, whose first steps have large coefficients:
(2,) 1.0, (3,) 95 (diverged), (2, 4) 0.07, (1, 2, 3) 0.025. Hence `default_restarts`: (3,)
up to 5 steps (made for ns5, the registered ``method="gram"``), every second step from 2
beyond. No bf16 Gram Polar Express is registered: it needs a restart nearly every step,
which removes the saving; `gram_newton_schulz` with Polar Express coefficients is exact in
float32/float64 (tested) if wanted.

**Cost** (flops, m <= n; counted by ``benchmarks/flops.py``). Five steps with one restart cost
``8 m^2 n + 28 m^3`` against ``20 m^2 n + 10 m^3`` for the plain quintic, so Gram pays when
n is more than about 1.5 m (0.67x at n = 4 m); for squarer matrices `gram_newton_schulz` runs
the plain quintic (``min_aspect``).

Pure functions unless given storage, like `muonclip.ortho._newton_schulz` (`muonclip.fast._buffered`
runs the same iteration into kept buffers).

Reference: J. Zhang, N. Amsel, B. Chen, T. Dao, "Gram Newton–Schulz: A Fast, Hardware-Aware
Newton–Schulz Algorithm for Muon" (2026), https://tridao.me/blog/2026/gram-newton-schulz/.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import Tensor

from ..common.defaults import AUTO, EPS, ORTH_DTYPE
from ._newton_schulz import Scratch, gram, no_scratch, normalized, quintic, small_side
from ._precision import auto_dtype

GRAM_MIN_ASPECT = 1.5


def default_restarts(steps: int) -> tuple[int, ...]:
    """Restart steps used when none are given: (3,) for up to 5 steps, else 2, 4, 6, ...

    Measured in bf16 (module docstring); Dao-AILab's (2,) is tuned for fp16.
    """
    return (3,) if steps <= 5 else tuple(range(2, steps, 2))


def gram_iteration(
    X: Tensor,  # (batch, p, q), wide or tall, normalised so that ||X||_2 <= 1
    coefficients: Sequence[tuple[float, float, float]],
    restarts: Collection[int] | None = None,
    *,
    out: Tensor | None = None,
    scratch: Scratch = no_scratch,
) -> Tensor:
    """The quintic steps of ``coefficients`` on X, done on its small Gram matrix (`gram`: ``X X^T``
    wide, ``X^T X`` tall; Q applied on that side by `small_side`): the one definition of the Gram
    iteration (the buffered workspace runs it with its kept storage).

    ``restarts``: step indices before which X and its Gram matrix are recomputed (index 0 is
    ignored: step 0 always starts from X); None means `default_restarts`. ``out``: X's shape,
    where the result goes (default None: a new tensor; X itself is never written). ``scratch``
    (`muonclip.ortho._newton_schulz.Scratch`): storage for the m x m temporaries (``"ns.R"``,
    ``"ns.Z"``, ``"ns.Q"``, ``"ns.RZ"``) and a restart's X (``"ns.X"``).
    """
    if restarts is None:
        restarts = default_restarts(len(coefficients))
    dtype, device, small = X.dtype, X.device, (X.shape[0], *[min(X.shape[-2:])] * 2)
    kept_R = scratch("ns.R", small, dtype, device)  # R's storage (None: a new tensor each time)
    R = gram(X, out=kept_R)  # (batch, m, m)
    Q: Tensor | None = None
    last = len(coefficients) - 1
    for i, (a, b, c) in enumerate(coefficients):
        if i != 0 and i in restarts and Q is not None:
            X = small_side(Q, X, out=scratch("ns.X", X.shape, dtype, device, X))
            R, Q = gram(X, out=kept_R), None
        Z = torch.baddbmm(R, R, R, beta=b, alpha=c, out=scratch("ns.Z", small, dtype, device))  # b R + c R^2
        if Q is None:
            q = scratch("ns.Q", small, dtype, device)
            Q = Z.clone() if q is None else q.copy_(Z)
            Q.diagonal(dim1=-2, dim2=-1).add_(a)  # a I + Z
        else:
            Q = torch.baddbmm(Q, Q, Z, beta=a, out=scratch("ns.Q", small, dtype, device, Q))  # Q (a I + Z)
        if i < last and (i + 1) not in restarts:
            RZ = torch.baddbmm(R, R, Z, beta=a, out=scratch("ns.RZ", small, dtype, device))  # a R + R Z
            R = torch.baddbmm(RZ, Z, RZ, beta=a, out=kept_R)  # (a I + Z) R (a I + Z)
    if Q is None:
        return X.clone() if out is None else out.copy_(X)
    return small_side(Q, X, out=out)


def uses_gram(A: int, B: int, min_aspect: float = GRAM_MIN_ASPECT) -> bool:
    """True when an A x B matrix runs on its Gram matrix: ``max(A, B) >= min_aspect * min(A, B)``."""
    return max(A, B) >= min_aspect * min(A, B)


def gram_newton_schulz(
    V: Tensor,  # (..., A, B)
    coefficients: Sequence[tuple[float, float, float]],
    *,
    dtype: torch.dtype | str = ORTH_DTYPE,
    eps: float = EPS,
    norm_scale: float = 1.0,
    restarts: Collection[int] | None = None,
    min_aspect: float = GRAM_MIN_ASPECT,
    out: Tensor | None = None,
    scratch: Scratch = no_scratch,
) -> Tensor:
    """Approximate the polar factor of each matrix in ``V`` by Gram Newton–Schulz.

    Same contract and pre-processing as `muonclip.ortho.newton_schulz` (cast,
    divide by ``||X||_F * norm_scale + eps``, work on the small Gram matrix's side); the steps
    run on the Gram matrix when ``max(A, B) >= min_aspect * min(A, B)`` (`uses_gram`), otherwise
    as the plain quintic (no flops to save on squarish matrices).

    Args:
        V: matrices of shape ``(..., A, B)``; leading dimensions are a batch.
        coefficients: one (a, b, c) per step.
        dtype: compute dtype (default ``"auto"``, as `muonclip.ortho.newton_schulz`; float64 also
            works, and float16, very slowly on CPUs without native fp16 matmul).
        eps: added to the Frobenius norm before the division (default 1e-7).
        norm_scale: the Frobenius norm is multiplied by this first (default 1.0).
        restarts: step indices before which X and R are recomputed (default None:
            `default_restarts`, i.e. (3,) for 5 steps).
        min_aspect: smallest ``max(A, B) / min(A, B)`` that uses the Gram form (default 1.5).
        out, scratch: storage for the result and the temporaries, as for
            `muonclip.ortho.newton_schulz` (given ``out``, ``V`` is normalised in place).

    Returns:
        The result, of ``V``'s shape, in ``dtype`` (in ``out`` when given).
    """
    dtype = auto_dtype(V.device) if dtype == AUTO else dtype
    X = normalized(V, dtype, eps, norm_scale, inplace=out is not None)
    if uses_gram(*V.shape[-2:], min_aspect):
        return gram_iteration(X, coefficients, restarts, out=out, scratch=scratch).reshape(V.shape)
    return quintic(X, coefficients, out=out, scratch=scratch).reshape(V.shape)
