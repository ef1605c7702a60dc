"""Newton–Schulz iterations that map a matrix to (approximately) its polar factor U V^T.

Two coefficient schedules share one iteration (design.md 1.2):

* ``ns5`` — Keller Jordan's quintic, one fixed (a, b, c) = (3.4445, -4.7750, 2.0315) for every
  step. Fast, deliberately inexact: singular values land in about [0.68, 1.13].
* ``polar_express`` — Amsel et al., "The Polar Express" (arXiv 2505.16932): a minimax-optimal
  (a, b, c) per step; 5–6 steps bring every singular value within 0.01 of 1.

Every function takes a batch ``X`` of shape ``(..., A, B)`` and returns the same shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from . import scratch as scratch_buffers
from .chunks import choose_chunk
from .scratch import kept

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


def gram_shape(X: Tensor) -> tuple[int, int, int]:
    """The shape of `gram` of ``X`` (batch, p, q): ``(batch, m, m)``, m = min(p, q)."""
    m = min(X.shape[-2:])
    return X.shape[0], m, m


def small_side(P: Tensor, X: Tensor, beta: float | None = None, out: Tensor | None = None) -> Tensor:
    """``P`` (batch, m, m), symmetric, applied to ``X`` on its small side: ``P X`` for a wide or
    square X, ``X P`` for a tall one (the transpose of ``P X^T``); with ``beta``, ``beta X`` is
    added in the same product (one rounding)."""
    tall = X.shape[-2] > X.shape[-1]
    left, right = (X, P) if tall else (P, X)
    if beta is None:
        return torch.bmm(left, right, out=out)
    return torch.baddbmm(X, left, right, beta=beta, out=out)


def tracked(X: Tensor) -> bool:
    """True when autograd records operations on ``X``: the iterations then make new tensors
    (``out=`` and in-place writes would refuse or break differentiation), as plain torch does."""
    return torch.is_grad_enabled() and X.requires_grad


def quintic_iteration(
    X: Tensor,  # (batch, p, q), wide or tall, already normalised so that ||X||_2 <= 1
    coefficients: Sequence[tuple[float, float, float]],
    out: Tensor | None = None,
    scratch: dict | None = None,
) -> Tensor:
    """Run ``X <- a X + (b S + c S S) X`` with ``S = X X^T`` once per (a, b, c).

    A tall X runs the same polynomial from the right, ``X <- a X + X (b S + c S S)`` with
    ``S = X^T X`` (`gram`, `small_side`): the transpose of the wide form, with every operand in
    its stored layout (no transposed copies). Costs 4 m^2 n + 2 m^3 flops a step, m <= n the
    sides. ``X`` is consumed: it is overwritten. ``out`` (optional, X's shape and dtype, not
    aliasing X) receives the last step's product, so a chunked caller needs no concatenation;
    the result is returned either way. ``scratch``: where S and P are kept between calls
    (`muonclip.ortho.scratch`; default None: allocated per step). Under autograd (X requires
    grad) every step makes new tensors instead, so the result can be differentiated.

    The steps alternate between two X-shaped tensors, the result (``out``, or one new tensor)
    and ``X`` itself, free once step 0 has read it; only step 0 of an even number of steps needs
    a third (kept in ``scratch`` as ``"ns.X"``). The result is thus written on every second
    step and is still in cache when the last step writes it, and the iteration touches two
    X-sized buffers instead of four (measured on 24 x 384 x 384 bf16, 2 cores: 3 ms of 25).
    """
    last = len(coefficients) - 1
    dtype, device, small = X.dtype, X.device, gram_shape(X)
    differentiable = tracked(X)
    spare = X
    if out is None and not differentiable:
        out = torch.empty_like(X)
    for i, (a, b, c) in enumerate(coefficients):
        S = gram(X, out=kept(scratch, "ns.S", small, dtype, device))  # (batch, m, m)
        P = torch.baddbmm(S, S, S, beta=b, alpha=c, out=kept(scratch, "ns.P", small, dtype, device))  # b S + c S S
        if differentiable:
            nxt = out if i == last else None
        elif (last - i) % 2 == 0:
            nxt = out
        else:
            nxt = spare if i > 0 else kept(scratch, "ns.X", X.shape, dtype, device)
        X = small_side(P, X, beta=a, out=nxt)  # a X + P X
    return into(out, X)


def into(out: Tensor | None, X: Tensor) -> Tensor:
    """``X`` written into ``out`` when given and not already there; returns the result tensor."""
    if out is None or out is X:
        return X
    return out.copy_(X)


def result_view(buffer: Tensor, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """The first ``prod(shape)`` elements of ``buffer`` viewed as ``shape``; ValueError if unfit."""
    n = math.prod(shape)
    if buffer.dtype != dtype or buffer.device != device or not buffer.is_contiguous() or buffer.numel() < n:
        raise ValueError(
            f"buffer must be a contiguous {dtype} tensor on {device} with at least {n} elements; got "
            f"{buffer.dtype} on {buffer.device}, {buffer.numel()} elements, contiguous={buffer.is_contiguous()}"
        )
    return buffer.view(-1)[:n].view(*shape)


def newton_schulz(
    V: Tensor,  # (..., A, B)
    coefficients: Sequence[tuple[float, float, float]],
    *,
    dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
    norm_scale: float = 1.0,
    iteration: Callable[..., Tensor] | None = None,
    buffer: Tensor | None = None,
    scratch: dict | None = None,
    overwrite: bool = False,
) -> Tensor:
    """Approximate the polar factor of each matrix in ``V`` by a quintic Newton–Schulz run.

    Algorithm (per matrix): cast to ``dtype``; divide by ``||X||_F * norm_scale + eps`` (a zero
    matrix stays zero, never NaN); run one quintic step per triple in ``coefficients``, on the
    small Gram matrix's side (a tall matrix from the right: the transpose of the wide form,
    with no transposed copy). On CPU the batch may run in chunks of matrices
    (`muonclip.ortho.chunks`: the fastest chunk on this machine, timed on the first call for a
    shape; the same result, bit for bit, as one call), each normalised just before its steps
    and written into one preallocated result.

    Args:
        V: matrices of shape ``(..., A, B)``; leading dimensions are a batch.
        coefficients: one (a, b, c) per step.
        dtype: compute dtype (default bf16).
        eps: added to the Frobenius norm before the division (default 1e-7).
        norm_scale: the Frobenius norm is multiplied by this first (Polar Express uses 1.01).
        iteration: ``iteration(X, coefficients, out=None, scratch=None)`` runs the steps on
            the normalised ``(batch, A, B)`` batch (wide or tall: `gram` and `small_side` take
            either), writing the result into ``out`` when given and keeping its temporaries in
            ``scratch`` (default None: `quintic_iteration`; the Gram and symmetric forms in
            `muonclip.ortho.gram` / `.symmetric` plug in here).
        buffer: storage for the result (default None: a new tensor): a contiguous tensor of
            ``dtype`` on ``V``'s device with at least ``V.numel()`` elements, of any shape, not
            overlapping ``V``; the result is a view of its first ``V.numel()`` elements. A
            caller that orthogonalises every step keeps one (on CPU a fresh multi-MB result is
            page-faulted in again each time).
        scratch: a dict the caller keeps between calls, where the normalised input and the
            iteration's temporaries are kept on CPU (`muonclip.ortho.scratch`; default None:
            allocated per call).
        overwrite: whether ``V`` may be overwritten (default False: ``V`` is left as it was).
            The normalised input is then written over the ``dtype`` copy of ``V`` in place, and
            the iteration uses it as a working buffer: one matrix-sized buffer less, and no
            pass to a cold one. A ``V`` that must be cast or copied to ``dtype`` anyway (e.g.
            float32 in, bf16 computed) is always normalised in its own copy, which is not ``V``.

    Returns:
        A tensor of ``V``'s shape, in ``dtype`` (a view of ``buffer`` when given).
    """
    *batch, A, B = V.shape
    X = V.reshape(-1, A, B).to(dtype)
    # X is ours to overwrite when allowed, or when the cast made it a copy (not traced when compiling);
    # never under autograd, where every step makes new tensors (orthogonalize stays differentiable)
    if tracked(X):
        in_place, scratch = False, None
    else:
        in_place = overwrite or (
            not torch.compiler.is_compiling() and X.untyped_storage().data_ptr() != V.untyped_storage().data_ptr()
        )
    denom = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) * norm_scale + eps
    run = iteration or quintic_iteration
    N = X.shape[0]
    if X.numel() * X.element_size() < scratch_buffers.KEEP_BYTES:
        scratch = None  # small temporaries: nothing to keep (`kept` would say None to each)
    out = None if buffer is None else result_view(buffer, X.shape, X.dtype, X.device)

    def normalised(i: int, j: int, in_place: bool) -> Tensor:
        """Matrices i..j-1 divided by their norms (over themselves when ``in_place``)."""
        Xs, ds = (X, denom) if j - i == N else (X[i:j], denom[i:j])
        return torch.div(Xs, ds, out=Xs if in_place else kept(scratch, "ns.in", Xs.shape, X.dtype, X.device))

    def chunked(k: int, out: Tensor | None = None, in_place: bool = False) -> Tensor:
        """The batch's result, run ``k`` matrices at a time, written into ``out`` if given
        (X left intact unless ``in_place``: the chunk choice runs this several times)."""
        if k >= N:
            return run(normalised(0, N, in_place), coefficients, out=out, scratch=scratch)
        if out is None:
            out = torch.empty(X.shape, dtype=X.dtype, device=X.device)
        for i in range(0, N, k):  # each chunk normalised just before its steps (still in cache)
            run(normalised(i, min(i + k, N), in_place), coefficients, out=out[i : i + k], scratch=scratch)
        return out

    X = chunked(choose_chunk(X, run, len(coefficients), chunked), out, in_place=in_place)
    return X.reshape(*batch, A, B)
