"""Which part of a global tensor each rank holds, for any placement torch's DTensor APIs produce.

The distributed step (`muonclip.distributed.engine`) moves pieces of matrices between ranks, so
it must know, for every parameter and every rank of the mesh, which global indices that rank's
local tensor holds. This module computes that without communication, from the global shape,
the mesh shape, a rank's mesh coordinate and the placements (docs/design.md, "Distributed Muon"):

* ``Replicate()`` on a mesh dimension: every coordinate along it holds the same piece;
* ``Shard(d)``: dimension d is split like ``torch.chunk`` (blocks of ``ceil(n / k)``, the last
  ones shorter or empty: uneven shards), applied left to right over the mesh dimensions;
* ``_StridedShard(d, split_factor=s)`` (what FSDP2's ``fully_shard`` makes of a tensor-parallel
  shard on a 2-D mesh): the split torch defines for it (`torch.distributed.tensor.placement_types`),
  which may give a rank indices that are not contiguous.

A piece is one index set per tensor dimension: a ``range`` when contiguous (every case FSDP2,
tensor parallel and HSDP produce), else a tuple of the global indices in local order. The
local tensor is then exactly ``global[i_0, i_1, ...]`` over the product of those sets.
``Partial`` placements (pending reductions) are refused: a parameter is never partial.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

Index = range | tuple[int, ...]
Piece = tuple[Index, ...]


def _normalise(idx: Sequence[int]) -> Index:
    """``range`` when the indices are consecutive and increasing, else the tuple."""
    idx = tuple(int(i) for i in idx)
    if not idx:
        return range(0)
    if idx == tuple(range(idx[0], idx[0] + len(idx))):
        return range(idx[0], idx[0] + len(idx))
    return idx


def piece_of(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
             placements: Sequence[object], name: str = "a parameter") -> Piece:
    """The global indices, per dimension, of the local tensor at mesh coordinate ``coord``.

    Args:
        shape: the DTensor's global shape.
        mesh_shape: its device mesh's shape.
        coord: the coordinate of the rank on that mesh.
        placements: one placement per mesh dimension.
        name: the parameter's name, for errors.

    Raises:
        ValueError: a ``Partial`` (or unknown) placement.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode

    idx: list[Index] = [range(n) for n in shape]
    for mesh_dim, pl in enumerate(placements):
        if isinstance(pl, Replicate):
            continue
        if isinstance(pl, _StridedShard):
            d = pl.dim % len(shape)
            size, offs = pl.local_shard_size_and_offset(len(idx[d]), mesh_shape[mesh_dim], coord[mesh_dim],
                                                        _StridedShardOffsetMode.ALL)
            cur = idx[d]
            idx[d] = _normalise([cur[i] for i in (offs or [])][:size])
        elif isinstance(pl, Shard):
            d = pl.dim % len(shape)
            size, off = Shard.local_shard_size_and_offset(len(idx[d]), mesh_shape[mesh_dim], coord[mesh_dim])
            cur = idx[d]
            idx[d] = _normalise(cur[off: off + size]) if size else range(0)
        else:
            raise ValueError(
                f"{name} is placed {pl} on mesh dimension {mesh_dim}; Muon needs the parameter's values, so "
                "only Shard, the strided shard FSDP2 makes, and Replicate placements are supported (a Partial "
                "placement is a pending reduction: redistribute the parameter first)"
            )
    return tuple(idx)


def piece_shape(piece: Piece) -> tuple[int, ...]:
    """The local shape a piece has."""
    return tuple(len(i) for i in piece)


def is_empty(piece: Piece) -> bool:
    """True when the piece holds no element (an uneven split left this rank nothing)."""
    return any(len(i) == 0 for i in piece)


def contiguous(index: Index) -> bool:
    """True for a range (consecutive global indices)."""
    return isinstance(index, range)


def take(whole: Tensor, piece: Piece, within: Piece | None = None) -> Tensor:
    """The elements of ``piece`` from ``whole``, which holds the indices ``within`` (default: all)."""
    out = whole
    for d, ix in enumerate(piece):
        base = within[d] if within is not None else range(whole.shape[d])
        if isinstance(ix, range) and isinstance(base, range):
            out = out.narrow(d, ix.start - base.start, len(ix))
        else:
            pos = {g: p for p, g in enumerate(base)}
            out = out.index_select(d, torch.tensor([pos[g] for g in ix], device=whole.device))
    return out


def put(whole: Tensor, piece: Piece, value: Tensor, within: Piece | None = None) -> None:
    """Write ``value`` (shaped like ``piece``) into ``whole`` (holding ``within``, default all) in place."""
    base = within if within is not None else tuple(range(n) for n in whole.shape)
    if all(isinstance(i, range) for i in piece) and all(isinstance(b, range) for b in base):
        whole[tuple(slice(i.start - b.start, i.stop - b.start) for i, b in zip(piece, base))].copy_(value)
        return
    ix = []
    for d, (i, b) in enumerate(zip(piece, base)):
        pos = {g: p for p, g in enumerate(b)}
        shape = [1] * len(piece)
        shape[d] = len(i)
        ix.append(torch.tensor([pos[g] for g in i], device=whole.device).view(shape))
    whole[tuple(ix)] = value


def covers(piece: Piece, shape: Sequence[int], dims: Sequence[int]) -> bool:
    """True when ``piece`` holds every index of the dimensions ``dims`` of a tensor of ``shape``."""
    return all(piece[d] == range(shape[d]) for d in dims)


__all__ = ["Index", "Piece", "contiguous", "covers", "is_empty", "piece_of", "piece_shape", "put", "take"]
