"""`BufferedBackend`: Muon's buckets orthogonalised into buffers kept between steps (CPU).

A backend (`muonclip.optim.backend.Backend`) decides where a Muon step's bucket of same-shape
matrices lives and how it is orthogonalised. The core's (`CoreBackend`) allocates every tensor
afresh and calls the pure `muonclip.orthogonalize`. On a CPU, fresh multi-MB tensors are
page-faulted in again on every step (glibc hands large freed blocks back to the OS), so this
backend, for ``"ns5"``, ``"polar_express"`` and ``"gram"`` on CPU tensors:

* keeps the bucket's input and result, and the iteration's temporaries (S, P; Gram's R, Z,
  Q), in `muonclip.fast.kept_buffers.Buffers` held by the backend object, reused by every bucket
  and every step (scratch, not state: a copy of the optimizer starts without them);
* normalises the bucket in place and alternates the quintic's steps between it and the result,
  so a call touches two matrix-sized buffers besides S and P instead of a new one per step;
* optionally runs the batch in chunks of matrices (``chunk``: `muonclip.fast.chunks`; off by
  default).

Without chunking it makes exactly the core's products on the same values, so its result equals
the core's bit for bit; only where the tensors live differs. Other methods, other devices and
inputs that require grad go to the core `muonclip.orthogonalize` unchanged.

`muonclip.Muon` uses it by default for CPU parameters (``backend="auto"``): docs/benchmarks.md
gives the measured difference on the benchmark GPT set.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import Tensor

from ..ortho import check_input, check_method, ns5_schedule, run_method
from ..ortho.gram import default_restarts, uses_gram
from ..ortho.newton_schulz import POLAR_EXPRESS_SAFETY, gram, overflow_scale, polar_express_coefficients, small_side
from .chunks import check_chunk, chunk_size
from .kept_buffers import Buffers

BUFFERED_METHODS = ("ns5", "polar_express", "gram")
"""The methods this backend runs in kept buffers (the others run as the core runs them)."""


class BufferedBackend:
    """Orthogonalise Muon's buckets into buffers kept between steps (see module docstring).

    Args:
        chunk: matrices per Newton–Schulz run on CPU (default None: the whole batch; an int;
            or ``"cache"``: cache-sized chunks; `muonclip.fast.chunks`).

    Attributes:
        buffers: the kept `muonclip.fast.kept_buffers.Buffers`.
    """

    name = "buffered"

    def __init__(self, chunk: int | str | None = None) -> None:
        check_chunk(chunk)
        self.chunk = chunk
        self.buffers = Buffers()

    def empty(self, role: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """A tensor for ``role`` (e.g. a bucket's input), cut from a kept buffer on CPU."""
        return self.buffers.empty(role, shape, dtype, device)

    def orthogonalize(self, V: Tensor, method: str, steps: int | None = None, dtype: torch.dtype | None = None, *,
                      eps: float = 1e-7, coefficients: Sequence[float] | None = None,
                      reuse_result: bool = False) -> Tensor:
        """`muonclip.orthogonalize` of the batch ``V``, which this call may overwrite.

        ``reuse_result``: the result may live in a kept buffer that the next call overwrites
        (default False: a new tensor), for a caller that uses it before calling again.
        """
        m = check_method(method, steps, dtype, coefficients)
        check_input(V, eps)
        if (method not in BUFFERED_METHODS or V.device.type != "cpu" or V.ndim < 2 or V.numel() == 0
                or V.is_complex() or (torch.is_grad_enabled() and V.requires_grad)):
            return run_method(V, method, steps, dtype, eps=eps, coefficients=coefficients)
        steps = m.default_steps if steps is None else steps
        dtype = dtype or m.default_dtype
        if method == "polar_express":
            coeffs, norm_scale = polar_express_coefficients(steps), POLAR_EXPRESS_SAFETY
        else:
            coeffs, norm_scale = ns5_schedule(steps, coefficients), 1.0
        *_, A, B = V.shape
        X = V.reshape(-1, A, B).to(dtype)  # V itself when it is in dtype: ours to overwrite
        X.mul_(overflow_scale(X))  # exact: 1 unless the entries are huge (as muonclip.ortho.newton_schulz.normalized)
        denom = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) * norm_scale + eps
        out = self.buffers.get("result", X.shape, dtype, X.device) if reuse_result else None
        if out is None:
            out = torch.empty_like(X)
        on_gram = method == "gram" and uses_gram(A, B)
        N = X.shape[0]
        k = chunk_size(self.chunk, N, A, B, dtype, X.device)
        for i in range(0, N, k):  # each chunk normalised just before its steps (still in cache)
            Xs = torch.div(X[i : i + k], denom[i : i + k], out=X[i : i + k])
            if on_gram:
                gram_into(Xs, coeffs, out[i : i + k], self.buffers)
            else:
                quintic_into(Xs, coeffs, out[i : i + k], self.buffers)
        return out.view(V.shape).to(V.dtype)

    def __repr__(self) -> str:
        return f"BufferedBackend(chunk={self.chunk!r})"


def quintic_into(X: Tensor, coefficients: Sequence[tuple[float, float, float]], out: Tensor,
                 buffers: Buffers) -> Tensor:
    """`muonclip.ortho.newton_schulz.quintic` on the normalised batch ``X`` (overwritten), its
    result written into ``out`` (X's shape, not overlapping it), temporaries in ``buffers``.

    The steps alternate between ``out`` and ``X`` itself, free once step 0 has read it; only
    step 0 of an even number of steps needs a third X-sized buffer (kept as ``"ns.X"``). The
    result is thus written on every second step, and the call touches two X-sized buffers
    besides S and P. The same products as `quintic`, into other storage.
    """
    last = len(coefficients) - 1
    dtype, device, small = X.dtype, X.device, (X.shape[0], *[min(X.shape[-2:])] * 2)
    spare = X
    for i, (a, b, c) in enumerate(coefficients):
        S = gram(X, out=buffers.get("ns.S", small, dtype, device))  # (batch, m, m)
        P = torch.baddbmm(S, S, S, beta=b, alpha=c, out=buffers.get("ns.P", small, dtype, device))  # b S + c S S
        if (last - i) % 2 == 0:
            nxt = out
        else:
            nxt = spare if i > 0 else buffers.get("ns.X", X.shape, dtype, device)
        X = small_side(P, X, beta=a, out=nxt)  # a X + P X
    return out


def gram_into(X: Tensor, coefficients: Sequence[tuple[float, float, float]], out: Tensor, buffers: Buffers,
              restarts: Collection[int] | None = None) -> Tensor:
    """`muonclip.ortho.gram.gram_iteration` on the normalised batch ``X``, its result written
    into ``out``, the m x m temporaries (R, Z, Q, R Z) and a restart's X in ``buffers``: the same
    products into other storage."""
    if restarts is None:
        restarts = default_restarts(len(coefficients))
    dtype, device, small = X.dtype, X.device, (X.shape[0], *[min(X.shape[-2:])] * 2)

    def keep(role: str, avoid: Tensor | None = None) -> Tensor | None:
        return buffers.get(role, small, dtype, device, avoid)

    R = gram(X, out=keep("ns.R"))  # (batch, m, m)
    Q: Tensor | None = None
    last = len(coefficients) - 1
    for i, (a, b, c) in enumerate(coefficients):
        if i != 0 and i in restarts and Q is not None:
            X = small_side(Q, X, out=buffers.get("ns.X", X.shape, dtype, device, avoid=X))
            R, Q = gram(X, out=R), None
        Z = torch.baddbmm(R, R, R, beta=b, alpha=c, out=keep("ns.Z"))  # b R + c R^2
        if Q is None:
            q = keep("ns.Q")
            Q = Z.clone() if q is None else q.copy_(Z)
            Q.diagonal(dim1=-2, dim2=-1).add_(a)  # a I + Z
        else:
            Q = torch.baddbmm(Q, Q, Z, beta=a, out=keep("ns.Q", avoid=Q))  # Q (a I + Z)
        if i < last and (i + 1) not in restarts:
            RZ = torch.baddbmm(R, R, Z, beta=a, out=keep("ns.RZ"))  # a R + R Z
            R = torch.baddbmm(RZ, Z, RZ, beta=a, out=R)  # (a I + Z) R (a I + Z)
    if Q is None:
        return out.copy_(X)
    return small_side(Q, X, out=out)


__all__ = ["BUFFERED_METHODS", "BufferedBackend", "gram_into", "quintic_into"]
