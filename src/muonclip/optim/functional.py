"""The Muon update, as functions: its phases, `muon_update` (one matrix) and `muon_step` (what
`muonclip.Muon.step` runs).

For one weight matrix W (or a batch of them, ``(E, A, B)``), with gradient G and momentum
buffer M (docs/design.md, "Muon")::

    M = mu M + G                             momentum_
    V = G + mu M   (nesterov)   or   V = M   muon_input
    O = orth(V)                              muonclip.orthogonalize, in the compute dtype
    W = W (1 - lr wd)                        apply_update_: decoupled weight decay, base lr,
    W = W - lr scale(A, B) O                 then the scaled update

`muon_update` is these lines for one matrix. `muon_step` runs the same phases for every Muon
weight of a step, with the blocks of equal shape batched into one ``orthogonalize`` call
(`muonclip.optim.buckets`): that is the step `muonclip.Muon` runs in one process. Over several
processes `muonclip.distributed` runs these phases too, with the exchanges around them.
`adamw_update` (`muonclip.optim.adamw`) is the AdamW branch's.

References:
    K. Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (2024).
    torch.optim.Muon (``torch/optim/_muon.py``), whose update this is with the scale
    ``adjust_lr_fn`` names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..ortho import run_method
from .buckets import Bucket, Results
from .matrices import MatrixSpec


def momentum_(momentum_buffer: Tensor, grad: Tensor, momentum: float) -> Tensor:
    """``M = momentum * M + G`` in place (one pass); returns ``M``."""
    return torch.add(grad, momentum_buffer, alpha=momentum, out=momentum_buffer)


def muon_input(grad: Tensor, momentum_buffer: Tensor, momentum: float, nesterov: bool,
               out: Tensor | None = None) -> Tensor:
    """The matrix Muon orthogonalises: ``V = G + momentum * M`` (Nesterov) or ``V = M``.

    Written into ``out`` when given (any dtype, e.g. a bfloat16 slot of a bucket: the sum is
    rounded once, into it), else a new tensor (or ``M`` itself without Nesterov).
    """
    if not nesterov:
        return momentum_buffer if out is None else out.copy_(momentum_buffer)
    return torch.add(grad, momentum_buffer, alpha=momentum, out=out)


def apply_update_(param: Tensor, update: Tensor, *, lr: float, weight_decay: float, scale: float) -> None:
    """``W = W (1 - lr wd)`` then ``W = W - lr * scale * O``, in place.

    ``update`` (``O``) is added as it is (e.g. bfloat16 into a float32 weight, as
    torch.optim.Muon does), with ``-lr * scale`` as the one coefficient: no scaled copy.
    """
    if weight_decay != 0.0:
        param.mul_(1.0 - lr * weight_decay)
    param.add_(update, alpha=-lr * scale)


def muon_update(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor,
    *,
    lr: float,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    method: str = "ns5",
    steps: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
    coefficients: Sequence[float] | None = None,
    scale: float = 1.0,
) -> None:
    """One Muon step of one matrix ``(A, B)`` or one batch ``(E, A, B)``, in place.

    Args:
        param: the weight W (float32, bfloat16 or float64).
        grad: its gradient G, W's shape.
        momentum_buffer: M, W's shape (float32 or wider), updated in place.
        lr: learning rate.
        weight_decay: decoupled weight decay, multiplied by ``lr`` (default 0.1).
        momentum: mu in [0, 1) (default 0.95).
        nesterov: orthogonalise ``G + mu M`` instead of ``M`` (default True).
        method, steps, eps, coefficients: of `muonclip.orthogonalize` (defaults: ns5, its 5
            steps, 1e-7, its coefficients).
        dtype: compute dtype of the orthogonalisation; V is rounded into it once (default
            bfloat16).
        scale: the update scale of the matrix shape (`muonclip.optim.scale.update_scale`;
            default 1.0).
    """
    momentum_(momentum_buffer, grad, momentum)
    V = muon_input(grad, momentum_buffer, momentum, nesterov, out=torch.empty_like(grad, dtype=dtype))
    O = run_method(V, method, steps, dtype, eps=eps, coefficients=coefficients)
    apply_update_(param, O, lr=lr, weight_decay=weight_decay, scale=scale)


class MuonWeight(NamedTuple):
    """One Muon weight in a step: its tensors (this process's, in their stored layout), how it
    is cut into matrices, and its group's settings for this step."""

    param: Tensor
    grad: Tensor
    momentum_buffer: Tensor
    spec: MatrixSpec
    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool


def muon_step(weights: Sequence[MuonWeight], buckets: Sequence[Bucket], backend: Any) -> int:
    """`muon_update` of every weight, one ``orthogonalize`` call per bucket of same-shape blocks.

    For each bucket (`muonclip.optim.buckets.make_buckets` of the weights' specs): each block's
    V is written into its slot in the compute dtype, right after its weight's momentum (once,
    at the weight's first block: G and M are still in cache); the bucket is orthogonalised by
    ``backend`` (`muonclip.optim.backend.Backend`, which may reuse the result's storage for the
    next bucket); every weight whose last block this was is updated at once, its blocks' row
    ranges each with their own scale. Returns the number of matrices orthogonalised.
    """
    results = Results([w.spec for w in weights], reuse_result=True)
    fresh = set(range(len(weights)))  # momentum not yet updated in this step
    matrices = 0
    for bucket in buckets:
        V = bucket.empty(backend)
        for k, b, slot in bucket.slots(V):
            w = weights[k]
            if k in fresh:
                fresh.discard(k)
                momentum_(w.momentum_buffer, w.grad, w.momentum)
            muon_input(w.spec.block(w.grad, b), w.spec.block(w.momentum_buffer, b), w.momentum, w.nesterov, out=slot)
        O = bucket.orthogonalize(V, backend, reuse_result=True)
        for k, O_k in results.of(bucket, O):
            w = weights[k]
            apply_blocks_(w.param, O_k, lr=w.lr, weight_decay=w.weight_decay, axis=w.spec.axis, ranges=w.spec.ranges)
        matrices += V.shape[0]
    return matrices


def apply_blocks_(param: Tensor, update: Tensor, *, lr: float, weight_decay: float, axis: int,
                  ranges: Sequence[tuple[int, int, float]], offset: int = 0) -> None:
    """`apply_update_` for a weight cut into matrix blocks, each with its own scale.

    ``ranges``: ``(a, b, scale)`` for the rows ``[a, b)`` along ``axis``
    (`muonclip.optim.matrices.MatrixSpec.ranges`). ``param`` and ``update`` hold the rows
    ``[offset, offset + n)`` along ``axis``, ``n = update.shape[axis]`` (all of them unless the
    weight is a shard of a larger one: a row shard, or a column shard of a transposed weight).
    The decay applies to all of ``param``, each range's update once.
    """
    if weight_decay != 0.0:
        param.mul_(1.0 - lr * weight_decay)
    for dst, src, scale in _pieces(param, update, axis, ranges, offset):
        apply_update_(dst, src, lr=lr, weight_decay=0.0, scale=scale)


def _pieces(param: Tensor, update: Tensor, axis: int, ranges: Sequence[tuple[int, int, float]],
            offset: int) -> list[tuple[Tensor, Tensor, float]]:
    """``(param rows, update rows, scale)`` of each range present here (whole tensors when one
    range covers everything: no views)."""
    n = update.shape[axis]
    if len(ranges) == 1 and offset == 0 and ranges[0][:2] == (0, n) and n == param.shape[axis]:
        return [(param, update, ranges[0][2])]  # the usual case: one block, all rows here
    out = []
    for a, b, s in ranges:
        lo, hi = max(a, offset), min(b, offset + n)
        if lo < hi:
            out.append((param.narrow(axis, lo - offset, hi - lo), update.narrow(axis, lo - offset, hi - lo), s))
    return out


__all__ = ["MuonWeight", "apply_blocks_", "apply_update_", "momentum_", "muon_input", "muon_step", "muon_update"]
