"""8-bit momentum: Muon's momentum buffer kept as int8 with a float32 scale per block.

With ``Muon(..., momentum_8bit=True)`` a Muon weight's momentum ``M`` is stored as

* ``momentum_int8``: int8, the weight's shape, ``q = round(127 * M / s)`` (round half to even);
* ``momentum_scale``: float32, one scale per block, ``s = max |M|`` over the block (absmax);

and each step dequantises it into a float32 buffer (``M = q * s / 127``), runs the momentum
update on it, forms V into the orthogonalisation bucket from that float32 ``M``, and quantises
``M`` back (`muonclip.optim.functional.muon_step`). Only the step's weight in flight is float32:
the stored state is about 1 byte per element (4 for float32).

**The blocks** (`blocks_of`): a block is at most `BLOCK` (256) consecutive elements of one *row*
of the stored tensor, along its last dimension (a flattened weight, ``flatten=True`` or 4-D and
more: along the flattened ``(out, in*kh*kw)`` row). Blocks start at column 0 of every row and
are also cut at the edges of the matrix blocks that run along the last dimension (the fused
splits of a weight stored ``(in, out)``, ``transposed=True``). So a block never crosses two rows,
and therefore never two matrices of a stack ``(E, A, B)`` (each expert's rows are its own), two
row blocks of a fused split (``split_sizes`` cut rows), or two shards of a parameter sharded
along any dimension but the last (FSDP2's ``Shard(0)``, tensor parallel's column-parallel
``Shard(0)``, expert parallel): each rank quantises its own rows with the same blocks as one
process. A parameter sharded along its last dimension (row-parallel ``Shard(1)`` of an
``(out, in)`` weight) would cut blocks: the distributed step refuses it with a message (keep that
parameter in a group without ``momentum_8bit``). The scale tensor has the weight's leading
dimensions and one column per block of a row: ``(*shape[:-1], n_blocks)`` (flattened weights:
``(shape[0], n_blocks)``), with the parameter's placements on the leading dimensions, so a
distributed checkpoint reshards it like the weight.

The error of one quantisation is at most ``s / 254`` per element (half a step of ``s / 127``).
Relative to bitsandbytes' 8-bit optimizers (Dettmers et al., "8-bit Optimizers via Block-wise
Quantization", arXiv 2110.02861), which use the same block-wise absmax scaling but a non-linear
"dynamic" code (more levels near zero), this is the linear int8 code: simpler, exact to
reproduce on any hardware (elementwise float32 arithmetic only), at a coarser resolution for the
block's small values.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..common._dtensor import is_dtensor
from ._matrices import MatrixSpec
from ._state_dicts import state_dtype

BLOCK = 256
"""The most elements of one row in one quantisation block."""

LEVELS = 127
"""int8 levels on each side of 0 (the code is symmetric: -127..127)."""


@dataclass(frozen=True)
class QuantBlocks:
    """How a tensor of one shape is cut into quantisation blocks (module docstring).

    Attributes:
        lead: the leading dimensions (one row each, flattened): ``shape[:-1]``, or ``shape[:1]``
            for a flattened weight.
        row: elements per row (``shape[-1]``, or ``prod(shape[1:])`` flattened).
        edges: the blocks' start columns within a row, then ``row``.
        regular: every block has ``BLOCK`` elements (no cut but the multiples of ``BLOCK``,
            which divides ``row``): the fast path.
    """

    lead: tuple[int, ...]
    row: int
    edges: tuple[int, ...]
    regular: bool

    @property
    def n_blocks(self) -> int:
        """Blocks per row."""
        return len(self.edges) - 1

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The scale tensor's shape for a (local) tensor of ``shape`` with these blocks' rows."""
        lead = tuple(shape[: len(self.lead)])
        return (*lead, self.n_blocks)


def blocks_of(shape: Sequence[int], flatten: bool, cuts: Sequence[int] = ()) -> QuantBlocks:
    """The blocks of a weight of ``shape``: rows along the last dimension (``flatten`` or 4-D
    and more: ``(shape[0], rest)``), cut every `BLOCK` columns and at ``cuts`` (the matrix-block
    edges along the last dimension)."""
    return _blocks_of(tuple(int(s) for s in shape), bool(flatten or len(shape) >= 4), tuple(sorted(set(cuts))))


@functools.lru_cache(maxsize=1024)
def _blocks_of(shape: tuple[int, ...], flat: bool, cuts: tuple[int, ...]) -> QuantBlocks:
    lead = shape[:1] if flat else shape[:-1]
    row = math.prod(shape[1:]) if flat else shape[-1]
    edges = sorted({*range(0, row, BLOCK), *(c for c in cuts if 0 < c < row), row}) if row else [0]
    regular = all(b - a == BLOCK for a, b in zip(edges, edges[1:])) if row % BLOCK == 0 else len(edges) == 2
    return QuantBlocks(lead, row, tuple(edges), regular)


def quant_blocks(shape: Sequence[int], spec: MatrixSpec) -> QuantBlocks:
    """The blocks of a Muon weight of ``shape`` seen as ``spec`` (`blocks_of`): cut at the
    matrix-block edges that run along its last dimension (a transposed weight's splits)."""
    cuts = [a for segs in spec.blocks for a, _ in segs] if spec.axis == len(shape) - 1 and spec.n_blocks > 1 else []
    return blocks_of(shape, spec.flatten, cuts)


def scale_like(p: Tensor, lay: QuantBlocks) -> Tensor:
    """Zero float32 scales (float64 for a float64 ``p``) for ``p``'s blocks: a DTensor with ``p``'s
    placements for a DTensor ``p`` (its leading dimensions are the weight's, so a checkpoint
    reshards it like ``p``)."""
    dtype = state_dtype(p)
    if not is_dtensor(p):
        return torch.zeros(lay.scale_shape(p.shape), dtype=dtype, device=p.device)
    from torch.distributed.tensor import DTensor

    loc = p.to_local()
    zeros = torch.zeros(lay.scale_shape(loc.shape), dtype=dtype, device=loc.device)
    shape = lay.scale_shape(p.shape)
    stride = tuple(int(math.prod(shape[i + 1:])) for i in range(len(shape)))
    return DTensor.from_local(zeros, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape),
                              stride=stride)


@functools.lru_cache(maxsize=1024)
def _block_index(edges: tuple[int, ...], device: torch.device) -> Tensor:
    sizes = torch.tensor([b - a for a, b in zip(edges, edges[1:])])
    return torch.repeat_interleave(torch.arange(len(sizes)), sizes).to(device)


def _rows(t: Tensor, lay: QuantBlocks) -> Tensor:
    return t.reshape(-1, lay.row)


def _per_column(scale_rows: Tensor, lay: QuantBlocks) -> Tensor:
    """A ``(rows, n_blocks)`` tensor repeated to ``(rows, row)``: each column gets its block's value."""
    if lay.regular:
        return scale_rows.repeat_interleave(lay.row // lay.n_blocks, dim=1)
    return scale_rows.index_select(1, _block_index(lay.edges, scale_rows.device))


def dequantize(q: Tensor, scale: Tensor, lay: QuantBlocks, dtype: torch.dtype = torch.float32) -> Tensor:
    """``M = q * s / 127``, a new contiguous tensor of ``q``'s shape in ``dtype``."""
    step = _per_column(scale.reshape(-1, lay.n_blocks).to(dtype), lay).div_(LEVELS)
    return (_rows(q, lay).to(dtype) * step).reshape(q.shape)


def quantize_(x: Tensor, q: Tensor, scale: Tensor, lay: QuantBlocks) -> None:
    """Store ``x`` (float32 or wider) into ``q`` (int8) and ``scale`` (float32) in place: ``s`` the
    absmax of each block, ``q = round(127 x / s)`` (0 where ``s`` is 0)."""
    rows = _rows(x, lay)
    if lay.regular:
        amax = rows.abs().reshape(rows.shape[0], lay.n_blocks, -1).amax(dim=-1)
    else:
        index = _block_index(lay.edges, x.device).expand(rows.shape[0], -1)
        amax = torch.zeros(rows.shape[0], lay.n_blocks, dtype=x.dtype, device=x.device)
        amax.scatter_reduce_(1, index, rows.abs(), reduce="amax", include_self=True)
    scale.reshape(-1, lay.n_blocks).copy_(amax)
    inv = torch.where(amax > 0, LEVELS / amax, torch.zeros_like(amax))
    codes = (rows * _per_column(inv, lay)).round_().clamp_(-LEVELS, LEVELS)
    q.view(rows.shape).copy_(codes) if q.is_contiguous() else q.copy_(codes.reshape(q.shape))
