"""How a parameter tensor is seen as matrices: `MatrixSpec`, computed once per shape and group.

Declared, not guessed (docs/design.md, "Which matrices: fused projections, heads and routers").
A param group says it with four keys, which `muonclip.param_groups` sets from the model:

* 2-D ``(A, B)``: one matrix.
* ``flatten=True`` or ndim >= 4 (convolutions ``(out, in, kh, kw)``): one ``(out, in*kh*kw)``
  matrix; the update scale uses that flattened shape.
* 3-D without ``flatten`` (stacked MoE experts ``(E, A, B)``): E independent matrices.
* ``transposed=True`` (2-D, or 3-D stacked experts): the weight is stored ``(in, out)``, as in
  transformers' ``Conv1D`` (GPT-2) and its experts declared ``is_transposed`` (``(E, in,
  out)``, gpt-oss), so each matrix is the transpose ``(out, in)``: the update scale and
  ``split_sizes`` refer to that ``(out, in)`` matrix. (Orthogonalisation itself does not
  care: orth(W^T) = orth(W)^T.)
* ``split_sizes`` (fused projections): the rows of each matrix are cut into blocks of those
  sizes, each block orthogonalised on its own (``[q | k | v]`` of a fused QKV weight,
  ``[gate | up]`` of a fused MLP).
* ``split_groups=G`` with ``split_sizes`` (interleaved fused projections): the rows are G
  equal consecutive groups (e.g. attention heads), each cut by ``split_sizes``; block i is
  part i of every group, in group order. GPT-NeoX stores ``query_key_value`` as
  ``[h0: q k v | h1: q k v | ...]``: ``split_sizes=[d, d, d], split_groups=n_heads`` makes
  the q map (every head's first ``d`` rows) one block, k another, v a third. Interleaved
  gate/up rows ``[g0, u0, g1, u1, ...]`` are ``split_sizes=[1, 1], split_groups=I``.

`matrix_spec` turns those keys and a shape into a `MatrixSpec`: where the rows of each block
are (``axis``, ``blocks``), each block's update scale (``adjust_lr_fn``), the row ranges the
update is applied by (``ranges``) and the Newton–Schulz flops. Everything the optimizer does
with a weight's matrices goes through it: `MatrixSpec.block` (write-through views of a block
of a tensor), `MatrixSpec.slot` (the same block of a bucket slot), and the numbers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..ortho import METHODS
from ..ortho._newton_schulz import ns_flops
from ._scale import update_scale

Ranges = tuple[tuple[int, int], ...]

WHOLE_MATRIX: Mapping[str, Any] = {"split_sizes": None, "split_groups": 1, "flatten": False, "transposed": False}
"""The matrix keys of a group that sets none (`muonclip.Muon`'s defaults): a 2-D weight is one
matrix, a 3-D one a stack of matrices, one of 4 or more dimensions ``(out, prod(rest))``."""


@dataclass(frozen=True)
class MatrixSpec:
    """One weight shape seen as matrices (see the module docstring).

    Attributes:
        shape: the stored (global) shape.
        axis: the stored dimension the matrix rows run along: 0 for 2-D and flattened
            weights, 1 for stacked experts ``(E, A, B)`` and for ``transposed`` 2-D weights
            stored ``(in, out)``, 2 for ``transposed`` stacked experts ``(E, in, out)``.
        transposed, flatten: the group's keys.
        batch: matrices per block (E for stacked experts, else 1).
        rows, cols: the ``(out, in)`` matrix's shape.
        split_sizes, split_groups: the group's keys (``split_sizes`` a tuple or None).
        blocks: each block's rows, as half-open ranges ``[a, b)`` along ``axis`` in group
            order (one range unless interleaved).
        scales: each block's update scale (``adjust_lr_fn`` of the block's shape).
        ranges: ``(a, b, scale)`` in row order, adjacent ranges of equal scale merged (every
            head of a per-head split, or q, k and v of equal shape, become one range: one add
            for the weight), for `muonclip.optim.functional.apply_blocks_`.
        flops: Newton–Schulz flops of one step of this weight (the method's steps, at least 1).
        n_blocks: how many blocks (1 for a weight orthogonalised whole).
    """

    shape: tuple[int, ...]
    axis: int
    transposed: bool
    flatten: bool
    batch: int
    rows: int
    cols: int
    split_sizes: tuple[int, ...] | None
    split_groups: int
    blocks: tuple[Ranges, ...]
    scales: tuple[float, ...]
    ranges: tuple[tuple[int, int, float], ...]
    flops: int
    n_blocks: int

    @property
    def experts(self) -> bool:
        """A stacked-expert weight: 3-D and not flattened (dimension 0 holds whole matrices)."""
        return len(self.shape) == 3 and not self.flatten

    def block_rows(self, b: int) -> int:
        """Rows of block ``b``'s matrix."""
        return sum(hi - lo for lo, hi in self.blocks[b])

    def block_offset(self, b: int) -> int:
        """Rows of the blocks before block ``b`` (where its rows start in a per-row buffer that
        holds the blocks one after another, like NorMuon's second moment)."""
        return sum(self.block_rows(i) for i in range(b))

    def block_shape(self, b: int) -> tuple[int, int, int, int]:
        """``(E, G, s_b, B)``: the shape of `block` ``b`` of a weight cut into several blocks."""
        groups = self.split_groups if self.split_sizes is not None else 1
        return (self.batch, groups, self.block_rows(b) // groups, self.cols)

    def matrix(self, t: Tensor) -> Tensor:
        """``t`` (of this shape) as the batch of matrices ``(E, A, B)``; a view of ``t``."""
        if self.transposed:
            return t.mT if t.ndim == 3 else t.mT.unsqueeze(0)
        if self.flatten or t.ndim >= 4:
            return t.reshape(1, t.shape[0], -1)
        return t if t.ndim == 3 else t.unsqueeze(0)

    def block(self, t: Tensor, b: int) -> Tensor:
        """Block ``b`` of ``t`` (of this shape): ``t`` itself when the weight is one block, else
        a write-through view shaped `block_shape` (``block.flatten(1, 2)`` is its ``(E, rows,
        B)`` matrix, rows in group order). ``t`` must be contiguous so that writes land in it
        (momentum and update buffers are)."""
        if self.n_blocks == 1:
            return t
        m = self.matrix(t)
        groups = self.split_groups
        g = m.unflatten(1, (groups, self.rows // groups))  # (E, G, S, B): always a view
        a = sum(self.split_sizes[:b])
        return g[:, :, a : a + self.split_sizes[b]]

    def slot(self, dst: Tensor, b: int) -> Tensor:
        """A bucket slot ``(E, rows_b, B)`` for block ``b``, laid out like ``block(t, b)``: in the
        weight's stored layout when the weight is one block (a strided transpose for
        ``transposed`` weights, so writes still land in the slot), else shaped `block_shape`."""
        if self.n_blocks > 1:
            return dst.view(self.block_shape(b))
        if self.transposed:
            return dst.mT if len(self.shape) == 3 else dst[0].mT
        return dst.view(self.shape)

    def blocks_of(self, t: Tensor) -> list[Tensor]:
        """Every block of ``t`` as a matrix batch ``(E, rows_b, B)``: views when the rows of a
        block are contiguous, gathered copies when interleaved (``split_groups > 1``)."""
        if self.n_blocks == 1:
            return [self.matrix(t)]
        return [self.block(t, b).flatten(1, 2) for b in range(self.n_blocks)]


def matrix_spec(shape: Sequence[int], group: Mapping[str, Any]) -> MatrixSpec:
    """The `MatrixSpec` of a weight of ``shape`` in param group ``group`` (its keys
    ``flatten``, ``split_sizes``, ``split_groups``, ``transposed``, ``adjust_lr_fn``,
    ``method`` and ``ns_steps``); computed once per distinct shape and keys.

    Raises:
        ValueError: the keys cannot apply to the shape (not a matrix, ``transposed`` on a
            flattened or 4-D weight, ``split_groups`` without ``split_sizes``, sizes that do
            not add up to the rows).
    """
    sizes = group["split_sizes"]
    steps = group["ns_steps"]
    if steps is None:
        steps = METHODS[group["method"]].default_steps
    return _spec(tuple(int(s) for s in shape), bool(group["flatten"]), None if sizes is None else tuple(sizes),
                 group["split_groups"], bool(group["transposed"]), group["adjust_lr_fn"], max(steps, 1))


@functools.lru_cache(maxsize=4096)
def _spec(shape: tuple[int, ...], flatten: bool, split_sizes: tuple[int, ...] | None, split_groups: int,
          transposed: bool, adjust_lr_fn: str | None, steps: int) -> MatrixSpec:
    if len(shape) < 2:
        raise ValueError(f"a tensor of shape {shape} is not a matrix")
    if transposed and (len(shape) not in (2, 3) or flatten):
        raise ValueError(
            f"transposed=True is for 2-D weights stored (in, out) or stacked 3-D (E, in, out) (transformers' Conv1D "
            f"and is_transposed experts), got shape {shape}{' with flatten=True' if flatten else ''}"
        )
    if transposed:
        axis, rows, cols, batch = len(shape) - 1, shape[-1], shape[-2], (shape[0] if len(shape) == 3 else 1)
    elif flatten or len(shape) != 3:
        axis, rows, cols, batch = 0, shape[0], math.prod(shape[1:]), 1
    else:
        axis, batch, rows, cols = 1, shape[0], shape[1], shape[2]
    if split_sizes is None:
        if split_groups != 1:
            raise ValueError(f"split_groups={split_groups} needs split_sizes (the parts of each group)")
        blocks: tuple[Ranges, ...] = (((0, rows),),)
    else:
        _check_sizes(split_sizes, split_groups, rows, shape)
        period, a, out = rows // split_groups, 0, []
        for s in split_sizes:
            out.append(tuple((g * period + a, g * period + a + s) for g in range(split_groups)))
            a += s
        blocks = tuple(out)
    n_rows = [sum(hi - lo for lo, hi in segs) for segs in blocks]
    scales = tuple(update_scale(adjust_lr_fn, n, cols) for n in n_rows)
    flops = ns_flops([(batch, n, cols) for n in n_rows], steps)
    return MatrixSpec(shape, axis, transposed, flatten, batch, rows, cols, split_sizes, split_groups, blocks, scales,
                      _merge(blocks, scales), flops, len(blocks))


def _merge(blocks: Sequence[Ranges], scales: Sequence[float]) -> tuple[tuple[int, int, float], ...]:
    """Row ranges ``(a, b, scale)`` in row order, adjacent ranges with the same scale merged."""
    merged: list[tuple[int, int, float]] = []
    for a, b, s in sorted((a, b, s) for segs, s in zip(blocks, scales) for a, b in segs):
        if merged and merged[-1][1] == a and merged[-1][2] == s:
            merged[-1] = (merged[-1][0], b, s)
        else:
            merged.append((a, b, s))
    return tuple(merged)


def _check_sizes(split_sizes: tuple[int, ...], split_groups: int, rows: int, shape: tuple[int, ...]) -> None:
    if isinstance(split_groups, bool) or not isinstance(split_groups, int) or split_groups < 1:
        raise ValueError(f"split_groups must be an int >= 1, got {split_groups!r}")
    if not split_sizes or any(isinstance(s, bool) or int(s) != s or s <= 0 for s in split_sizes):
        raise ValueError(f"split_sizes {list(split_sizes)} must be positive integers")
    if sum(split_sizes) * split_groups != rows:
        where = f" x split_groups={split_groups}" if split_groups != 1 else ""
        raise ValueError(
            f"split_sizes {list(split_sizes)}{where} must add up to the {rows} rows of a matrix of shape {shape}"
        )
