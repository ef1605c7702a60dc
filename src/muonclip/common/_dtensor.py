"""DTensor geometry: which part of a global tensor each rank holds, for any placement.

The ground floor of the package (`muonclip.common`): the distributed Muon step
(`muonclip.distributed`), QK-Clip on sharded weights (`muonclip.qkclip`) and the step metrics
(`muonclip.qkclip.step_metrics`) all ask where a parameter's elements live, and ask it here. No
communication: everything follows from the global shape, the mesh shape, a rank's mesh
coordinate and the placements (docs/design.md, "Distributed Muon"):

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

A DTensor on a submesh is placed among the ranks of its root mesh by `mesh_grid`; `replicas` counts the
ranks that hold each element; `local_rows` gives the row shard a per-row factor is applied to.

A piece may also be a `FlatRange`: a contiguous range of the tensor's elements in row-major
order, what a flattening wrapper hands a rank (DeepSpeed ZeRO's partitions,
`muonclip.integrations.deepspeed`). `piece_shape`, `is_empty`, `take`, `put` and `covers` take
both kinds; the local tensor of a `FlatRange` is 1-D.
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

Index = range | tuple[int, ...]


@dataclass(frozen=True)
class FlatRange:
    """Elements ``[start, stop)`` of a tensor flattened in row-major order (a 1-D local tensor).

    A rank's piece of a weight that a flattening wrapper partitioned by element count, not by
    dimension (DeepSpeed ZeRO). A piece holding every element is written as the whole-tensor
    tuple of ranges instead, so that its local tensor keeps the weight's shape.
    """

    start: int
    stop: int

    def __len__(self) -> int:
        return max(self.stop - self.start, 0)


Piece = tuple[Index, ...] | FlatRange


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
    """The local shape a piece has (``(n,)`` for a `FlatRange` of n elements)."""
    if isinstance(piece, FlatRange):
        return (len(piece),)
    return tuple(len(i) for i in piece)


def is_empty(piece: Piece) -> bool:
    """True when the piece holds no element (an uneven split left this rank nothing)."""
    if isinstance(piece, FlatRange):
        return len(piece) == 0
    return not all(piece)  # an Index (range or tuple) is false when empty


def repeated(pieces: Sequence[Piece]) -> bool:
    """Whether some non-empty piece of ``pieces`` (one per rank) is held by more than one rank."""
    held = [pc for pc in pieces if not is_empty(pc)]
    return len(set(held)) < len(held)


def contiguous(index: Index) -> bool:
    """True for a range (consecutive global indices)."""
    return isinstance(index, range)


def take(whole: Tensor, piece: Piece, within: Piece | None = None) -> Tensor:
    """The elements of ``piece`` from ``whole``, which holds the indices ``within`` (default: all;
    a `FlatRange` is taken from a ``whole`` that holds every element)."""
    if isinstance(piece, FlatRange):
        return whole.reshape(-1)[piece.start:piece.stop]
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
    if isinstance(piece, FlatRange):  # into a contiguous whole that holds every element
        whole.view(-1)[piece.start:piece.stop].copy_(value.reshape(-1))
        return
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
    """True when ``piece`` holds every index of the dimensions ``dims`` of a tensor of ``shape``
    (never for a `FlatRange`, which is never a whole tensor)."""
    if isinstance(piece, FlatRange):
        return False
    return all(piece[d] == range(shape[d]) for d in dims)



def is_dtensor(t: Any) -> bool:
    """True for a `torch.distributed.tensor.DTensor`, without importing that module (if nobody
    imported it, no DTensor can exist)."""
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(t, cls)



def local(t: Tensor) -> Tensor:
    """The rank-local tensor: ``t.to_local()`` for a DTensor (an alias: writes go through), else ``t``."""
    if is_dtensor(t):
        return t._local_tensor if not torch.is_grad_enabled() else t.to_local()
    return t


def local_rows(param: Tensor) -> tuple[Tensor, int]:
    """``(local_tensor, row_offset)``: the rows of ``param`` this rank holds and where they start.

    A plain tensor or a replicated DTensor: the whole tensor, offset 0. A DTensor whose local
    tensor holds every column and a contiguous block of rows — FSDP2 ``Shard(0)``, tensor-parallel
    ``ColwiseParallel`` (``Shard(0)``), FSDP2 on top of it (the strided shard of a 2-D mesh),
    HSDP — its local shard (an alias: writes go through) and the global index of its first row,
    so a per-row factor ``f`` (indexed by global row) applies as
    ``local * f[offset : offset + len(local)]``. Used by QK-Clip to scale each head's rows where
    they live (a head's rows may be split between two ranks). Raises ValueError for a DTensor
    split along any other dimension, or whose rows here are not contiguous.
    """
    data = param.data if isinstance(param, torch.nn.Parameter) else param
    if not is_dtensor(data):
        return data, 0
    piece = piece_of(data.shape, data.device_mesh.shape, data.device_mesh.get_coordinate(), data.placements)
    if any(ix != range(n) for ix, n in zip(piece[1:], data.shape[1:])) or not isinstance(piece[0], range):
        raise ValueError(
            f"a weight of shape {tuple(data.shape)} placed {data.placements} is split along a dimension other than "
            "the rows (or in non-contiguous rows); per-row scaling (QK-Clip) needs row shards (Shard(0): "
            "fully_shard, ColwiseParallel) or replicas"
        )
    return data._local_tensor, piece[0].start if len(piece[0]) else 0


def root_mesh(mesh: Any) -> Any:
    """The mesh ``mesh`` was sliced from (itself when it is not a submesh)."""
    get = getattr(mesh, "_get_root_mesh", None)
    return get() if get is not None else mesh


@functools.lru_cache(maxsize=64)
def mesh_grid(mesh: Any) -> tuple[tuple[int, ...], dict[int, tuple[int, ...]]]:
    """Every copy of ``mesh`` among the ranks of its root mesh, mapped by rank layout (not by name).

    A submesh has one copy per coordinate of the root dimensions it leaves out (FSDP2 over the
    ``"dp"`` dimension of a ``("dp", "tp")`` mesh: one ``"dp"`` mesh per tensor-parallel rank),
    and a DTensor on it holds the same tensor on every copy. This returns the grid
    ``(copies, *mesh.shape)`` and, for every global rank in one of the copies, its coordinate
    ``(copy, *coordinate in mesh)`` on that grid; the DTensor's placements on the grid are
    ``(Replicate(), *placements)``. The copies come from the mesh's own rank layout (torch's
    ``DeviceMesh._layout`` over the root's rank map), so any mesh torch builds maps: sliced by
    name, unflattened from a 1-D ``("world",)`` mesh (how torchtitan builds its meshes),
    flattened, or sliced from those. Without ``_layout`` (older torch) a submesh maps by the
    names of its root's dimensions. Cached per mesh: the caller must not modify the mapping.

    Raises:
        ValueError: (older torch only) a submesh whose dimension names are not its root's.
    """
    layout, rank_map = getattr(mesh, "_layout", None), getattr(mesh, "_rank_map", None)
    shape = tuple(mesh.shape)
    if layout is not None and rank_map is not None:
        grid = layout.remap_to_tensor(rank_map).reshape(-1, *shape)
    else:
        root = root_mesh(mesh)
        if root is mesh or root == mesh:
            grid = mesh.mesh.reshape(1, *shape)
        else:
            names, root_names = mesh.mesh_dim_names or (), root.mesh_dim_names or ()
            if not names or any(n not in root_names for n in names):
                raise ValueError(
                    f"a submesh with dimensions {names} of a mesh with dimensions {root_names} cannot be mapped to "
                    "its root by this torch (no DeviceMesh._layout): slice submeshes by name (mesh['dp'])"
                )
            inner = [root_names.index(n) for n in names]
            outer = [d for d in range(root.ndim) if d not in inner]
            grid = root.mesh.permute(*outer, *inner).reshape(-1, *shape)
    coords = dict(zip(grid.flatten().tolist(), itertools.product(*(range(n) for n in grid.shape))))
    return tuple(grid.shape), coords


def replicas(t: Tensor, world: int | None = None) -> int:
    """How many ranks of a process group hold each element of this rank's piece of ``t``.

    ``world`` is the group's size (default None: the default process group's; 1 without
    ``torch.distributed``). A plain tensor: every rank of the group. A DTensor: the product of
    its mesh's sizes along the dimensions it is replicated over, times the number of copies of
    its mesh the group holds (a DTensor on a submesh is the same tensor on every copy,
    `mesh_grid`). So a sum over the group's ranks of ``x / replicas(t)``, ``x`` a per-element
    figure of each rank's piece, counts every element of ``t`` once: MLA's rotary
    down-projection, which tensor parallelism leaves whole on each TP rank, counts once, not
    ``tp`` times.
    """
    if world is None:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if not is_dtensor(t):
        return world
    mesh = t.device_mesh
    copies = max(world // mesh.size(), 1)
    for size, placement in zip(mesh.shape, t.placements):
        if placement.is_replicate():
            copies *= size
    return copies
