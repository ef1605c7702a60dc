"""Buckets: same-shape matrix blocks orthogonalised in one call.

A Muon step cuts each weight into its matrix blocks (`muonclip.optim.matrices`: a 2-D weight is
one, stacked experts ``(E, A, B)`` are E, a fused weight with ``split_sizes`` one per part) and
groups the blocks of equal shape and orthogonalisation settings, across parameters and param
groups, into buckets. Each bucket is one ``(N, A, B)`` tensor written in place by the caller
(V straight into the compute dtype: never materialised in float32 and concatenated), one
``orthogonalize`` call, and its result handed back block by block. `muonclip.Muon` and the
distributed layer both run their buckets through `orthogonalize_buckets`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..ortho import METHODS
from .functional import merge_ranges
from .matrices import block_views, matrix_rows
from .scale import update_scale

STRUCTURAL_OPTIONS = ("method", "ns_steps", "orth_dtype", "eps", "ns_coefficients", "flatten", "split_sizes",
                      "transposed", "split_groups", "adjust_lr_fn")
"""The group options that change a step's buckets or scales (lr, weight decay, momentum and
Nesterov do not: they are read every step)."""


def matrix_options(group: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `muonclip.optim.matrices` that a param group sets."""
    return dict(flatten=group["flatten"], split_sizes=group["split_sizes"], transposed=group["transposed"],
                split_groups=group["split_groups"])


def method_steps(group: dict[str, Any]) -> int:
    """The group's iteration count: ``ns_steps``, or its method's default."""
    s = group["ns_steps"]
    return METHODS[group["method"]].default_steps if s is None else s


def frozen(v: Any) -> Any:
    """``v`` with lists turned into tuples (hashable, comparable)."""
    return tuple(frozen(x) for x in v) if isinstance(v, (list, tuple)) else v


def options_key(group: dict[str, Any]) -> tuple:
    """The group's `STRUCTURAL_OPTIONS`, hashable."""
    return tuple(frozen(group.get(o)) for o in STRUCTURAL_OPTIONS)


@dataclass
class Bucket:
    """Same-shape matrix blocks with the same settings: one ``orthogonalize`` call."""

    A: int
    B: int
    device: torch.device
    method: str
    steps: int | None
    dtype: torch.dtype | None
    eps: float
    coefficients: tuple[float, float, float] | None
    entries: list[tuple[int, int]] = field(default_factory=list)  # (item, block)
    sizes: list[int] = field(default_factory=list)  # matrices of each entry (E for stacked experts)
    views: list[tuple[int, ...]] = field(default_factory=list)  # each entry's block view shape (E, G, s, B)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the bucket is written and orthogonalised in."""
        return self.dtype or METHODS[self.method].default_dtype


def item_scales(group: dict[str, Any], shape: Sequence[int]) -> tuple[int, list[tuple[int, int, float]]]:
    """``(axis, ranges)``: a weight's matrix blocks as row ranges along ``axis`` with each
    block's update scale (`muonclip.optim.functional.merge_ranges`), for `apply_blocks_`."""
    axis, blocks, cols, _ = matrix_rows(shape, **matrix_options(group))
    sizes = [sum(b - a for a, b in segs) for segs in blocks]
    return axis, merge_ranges(blocks, [update_scale(group["adjust_lr_fn"], n, cols) for n in sizes])


def item_flops(group: dict[str, Any], shape: Sequence[int]) -> int:
    """Newton–Schulz flops of one weight's blocks (`muonclip.ortho.newton_schulz.ns_flops`)."""
    from ..ortho.newton_schulz import ns_flops

    _, blocks, cols, batch = matrix_rows(shape, **matrix_options(group))
    return ns_flops([(batch, sum(b - a for a, b in segs), cols) for segs in blocks], max(method_steps(group), 1))


def make_buckets(items: Sequence[tuple[dict[str, Any], Sequence[int], torch.device]],
                 owned: Iterable[int]) -> tuple[list[Bucket], dict[int, int]]:
    """The buckets of the ``owned`` items (``(group, global shape, device)`` each) and how many
    blocks each owned item has; blocks are bucketed by shape and settings, in item order."""
    buckets: dict[tuple, Bucket] = {}
    n_blocks: dict[int, int] = {}
    for k in owned:
        g, shape, device = items[k]
        _, blocks, cols, batch = matrix_rows(shape, **matrix_options(g))
        n_blocks[k] = len(blocks)
        groups = g["split_groups"] if g["split_sizes"] is not None else 1
        for b, segs in enumerate(blocks):
            rows = sum(r1 - r0 for r0, r1 in segs)
            fields = (rows, cols, device, g["method"], g["ns_steps"], g["orth_dtype"], g["eps"], g["ns_coefficients"])
            bucket = buckets.setdefault(frozen(fields), Bucket(*fields))
            bucket.entries.append((k, b))
            bucket.sizes.append(batch)
            bucket.views.append((batch, groups, rows // groups, cols))
    return list(buckets.values()), n_blocks


def as_stored(block: Tensor, shape: Sequence[int], group: dict[str, Any]) -> Tensor:
    """A bucket slot ``(E, A, B)`` that holds a whole weight, viewed in the weight's stored layout
    (for ``transposed`` weights the strided transpose, so writes still land in the slot)."""
    if group["transposed"]:
        return block.mT if len(shape) == 3 else block[0].mT
    return block.view(tuple(shape))


def orthogonalize_buckets(
    buckets: Sequence[Bucket],
    n_blocks: dict[int, int],
    groups: Sequence[dict[str, Any]],
    shapes: Sequence[Sequence[int]],
    write: Callable[[int, int, Tensor], None],
    done: Callable[[int, Tensor], None],
    backend: Any,
    *,
    reuse_result: bool,
) -> int:
    """Orthogonalise every bucket; returns the number of matrices.

    Args:
        buckets, n_blocks: from `make_buckets`.
        groups, shapes: each item's param group and the shape its result has.
        write: ``write(k, b, dst)`` writes item k's V into its bucket slot ``dst``: the slot in
            the weight's stored layout when the item is one block (`as_stored`), else block b
            of it shaped like ``block_views(t)[b]`` (``(E, G, s, B)``).
        done: ``done(k, O_k)`` receives item k's result, in its stored shape and the compute
            dtype, as soon as its last block is orthogonalised: a view into the bucket's result
            when the item is one block, else its blocks assembled into a new tensor.
        backend: where buckets live and how they are orthogonalised
            (`muonclip.optim.backend.Backend`).
        reuse_result: the backend may reuse a bucket's result storage for the next bucket (the
            caller's ``done`` has used every result of a bucket before the next one starts).
    """
    pieces: dict[int, list[Tensor | None]] = {k: [None] * n for k, n in n_blocks.items()}
    missing = dict(n_blocks)
    matrices = 0
    for bk in buckets:
        shape = (sum(bk.sizes), bk.A, bk.B)
        V = backend.empty("input", shape, bk.compute_dtype, bk.device)
        for (k, b), view, dst in zip(bk.entries, bk.views, V.split(bk.sizes)):
            write(k, b, as_stored(dst, shapes[k], groups[k]) if n_blocks[k] == 1 else dst.view(view))
        matrices += shape[0]
        O = backend.orthogonalize(V, bk.method, bk.steps, bk.dtype, eps=bk.eps, coefficients=bk.coefficients,
                                  reuse_result=reuse_result)
        for (k, b), r in zip(bk.entries, O.split(bk.sizes)):
            missing[k] -= 1
            # a block of an item still incomplete outlives this bucket: off a reused buffer
            pieces[k][b] = r.clone() if reuse_result and missing[k] else r
            if missing[k] == 0:
                done(k, _assemble(pieces.pop(k), shapes[k], groups[k]))
    return matrices


def _assemble(parts: list[Tensor | None], shape: Sequence[int], group: dict[str, Any]) -> Tensor:
    """An item's result from its blocks' results: the one block in the stored layout, or the
    blocks copied into a new tensor of ``shape``."""
    if len(parts) == 1:
        return as_stored(parts[0], shape, group)
    out = torch.empty(tuple(shape), dtype=parts[0].dtype, device=parts[0].device)
    for dst, r in zip(block_views(out, **matrix_options(group)), parts):
        dst.copy_(r.view(dst.shape))
    return out


__all__ = ["STRUCTURAL_OPTIONS", "Bucket", "as_stored", "frozen", "item_flops", "item_scales", "make_buckets",
           "matrix_options", "method_steps", "options_key", "orthogonalize_buckets"]
