"""Which process group a step runs on, and how each parameter is laid out across it.

`muonclip.distributed._engine` runs one Muon step over a process group (docs/design.md,
"Distributed Muon"). This module answers, once per step, the two questions it needs:

* the group: every rank of the DTensor parameters' device mesh, of any dimension (FSDP2's
  ``fully_shard``, tensor parallel, FSDP2 x TP, HSDP, expert parallel), or, for plain tensors,
  the default group when ``torch.distributed`` is initialised with more than one rank (DDP:
  parameters and gradients are replicated), or no group at all (world size 1, the trivial case
  of the same step); or the group the optimizer was given: under pipeline parallelism the
  stage's own ranks (`stage_context`), since the mesh then spans stages whose parameters differ;
* the layout of each parameter: for every rank of the group, the global indices its local
  tensor holds (`GroupContext.pieces`, computed by `muonclip.common._dtensor`).

Anything else is refused with an error that says what to change: a DTensor whose process
group was destroyed, parameters on different meshes, a ``Partial`` placement, a local shard
whose shape is not the one its placements give.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..common._dtensor import Piece, is_dtensor, mesh_grid, piece_of, piece_shape, root_mesh
from ..optim.multiprocess import LOCAL


def mesh_group(mesh: Any) -> Any:
    """One process group spanning every rank of ``mesh``: its group for a 1-D mesh, the default
    group when the mesh spans the world, else the mesh flattened to one dimension (a collective
    every rank of the mesh enters)."""
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return mesh._flatten().get_group()


def locals_and_group(tensors: Sequence[Tensor]) -> tuple[list[Tensor], Any]:
    """The rank-local tensors of ``tensors`` and the process group their DTensors span (None if none).

    For checks that must agree across ranks (e.g. "is any gradient non-finite?"): compute on
    the local shards, then reduce once over the returned group instead of letting DTensor
    issue one collective per tensor.
    """
    group = None
    out = []
    for t in tensors:
        if is_dtensor(t):
            if group is None and root_mesh(t.device_mesh).size() > 1:
                group = mesh_group(root_mesh(t.device_mesh))
            t = t._local_tensor
        out.append(t)
    return out, group


@dataclass(frozen=True)
class GroupContext:
    """The process group of one step: ``group`` None means one process (no collective).

    Attributes:
        group, rank, world_size: the group spanning every rank that holds a piece of a Muon
            parameter, this rank's index in it, its size.
        mesh_shape: the shape of the DTensor parameters' device mesh (``(world_size,)`` when
            there is none: every parameter is replicated).
        coords: ``coords[r]`` is the mesh coordinate of group rank r.
        ranks: ``ranks[r]`` is the global rank of group rank r.
    """

    group: Any
    rank: int
    world_size: int
    mesh_shape: tuple[int, ...] = (1,)
    coords: tuple[tuple[int, ...], ...] = ((0,),)
    ranks: tuple[int, ...] = (0,)

    def pieces(self, p: Tensor, name: str = "a parameter") -> list[Piece]:
        """Every group rank's piece of ``p`` (`muonclip.common._dtensor.piece_of`) from the
        rank layout of its mesh (`mesh_grid`); the whole tensor on every rank for a plain tensor.

        Raises:
            ValueError: ``p``'s mesh does not cover every rank of the group (its pieces there are
                undefined).
        """
        if not is_dtensor(p):
            return [tuple(range(n) for n in p.shape)] * self.world_size
        from torch.distributed.tensor import Replicate

        grid, where = mesh_grid(p.device_mesh)
        missing = [g for g in self.ranks if g not in where]
        if missing:
            raise ValueError(
                f"{name} lives on device mesh {p.device_mesh}, whose copies hold none of the ranks {missing} of the "
                f"group its optimizer steps on (global ranks {list(self.ranks)}): Muon cannot say what those ranks "
                "hold. Put every Muon parameter of one optimizer on one mesh or on submeshes of it"
            )
        placements = (Replicate(), *p.placements)
        return [piece_of(p.shape, grid, where[g], placements, name) for g in self.ranks]


SINGLE = GroupContext(None, 0, 1)


def collective_group(params: Sequence[Tensor], process_group: Any = None) -> Any:
    """The process group every collective of an optimizer over ``params`` uses (its step, the
    QK-Clip's max-logit reduction, the logging callbacks' reductions); None: no collective.

    The rule of `resolve_group`, without its checks: ``"local"`` is None; a ``ProcessGroup`` is
    itself (a pipeline stage's ranks: the clip's max-logit reduction and the logging sums stay
    within the stage); None (automatic) is the group spanning the DTensor parameters' device
    mesh, else the default group when ``torch.distributed`` is initialised with more than one
    rank. A group of one rank is None.
    """
    if process_group == LOCAL:
        return None
    group = process_group
    if group is None:
        mesh = next((root_mesh(p.device_mesh) for p in params if is_dtensor(p)), None)
        if mesh is not None:
            group = mesh_group(mesh) if mesh.size() > 1 else None
        elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            group = dist.group.WORLD
    if group is None or dist.get_world_size(group) == 1:
        return None
    return group


def resolve_group(params: Sequence[Tensor], name_of: Callable[[int], str], process_group: Any = None) -> GroupContext:
    """Find the group the Muon parameters ``params`` live on; validate their layouts.

    Args:
        params: the Muon parameters of the step (plain tensors and/or DTensors on one mesh of
            any dimension: FSDP2, tensor parallel, FSDP2 x TP, HSDP, expert parallel).
        name_of: ``name_of(i)`` is a readable name of ``params[i]``, for errors.
        process_group: ``None`` (default, automatic: every rank of the DTensors' mesh, else the
            default group when torch.distributed is initialised with world size > 1, else
            none), ``"local"`` (no communication: each process optimises on its own; not allowed
            with sharded DTensors), or a ``ProcessGroup``: for plain tensors, the ranks that
            replicate them; with DTensors, a group that holds every rank of this rank's copy of
            each parameter's mesh (a pipeline stage's ranks: `stage_context`).

    Raises:
        RuntimeError: a DTensor parameter is seen while torch.distributed is not initialised.
        ValueError: parameters on different meshes, a ``Partial`` placement, a local shard
            whose shape is not the one its placements give, or a given group that misses ranks
            holding pieces of this rank's parameters.
    """
    first = None
    for i, p in enumerate(params):
        if not is_dtensor(p):
            continue
        name = name_of(i)
        if not dist.is_initialized():
            raise RuntimeError(
                f"{name} is a DTensor but torch.distributed is not initialised (was the process group "
                "destroyed?). Call torch.distributed.init_process_group before the optimizer step"
            )
        mesh = root_mesh(p.device_mesh)
        if first is None:
            first = (mesh, name)
        elif mesh != first[0]:
            raise ValueError(
                f"{name} is on device mesh {p.device_mesh} but {first[1]} is on {first[0]}: all Muon parameters of "
                "one optimizer must share one mesh, or submeshes of one (mixed meshes). Use one optimizer per mesh"
            )
        _check_local_shape(p, name)
        mesh_grid(p.device_mesh)
    if process_group == LOCAL:
        if first is not None and any(is_dtensor(p) and p.device_mesh.size() > 1 for p in params):
            raise ValueError("process_group='local' cannot be used with parameters sharded over several ranks")
        return SINGLE
    if first is not None:
        mesh = first[0]
        if mesh.size() == 1:
            return SINGLE
        group = mesh_group(mesh)
        if process_group is not None and process_group is not group:
            return stage_context(params, name_of, process_group)
        ranks = dist.get_process_group_ranks(group)
        where = {int(g): tuple(int(c) for c in torch.nonzero(mesh.mesh == g)[0].tolist()) for g in mesh.mesh.flatten()}
        return GroupContext(group, dist.get_rank(group), len(ranks), tuple(mesh.shape), tuple(where[g] for g in ranks),
                            tuple(ranks))
    if process_group is not None:
        group = process_group
    elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        group = dist.group.WORLD
    else:
        return SINGLE
    world = dist.get_world_size(group)
    if world == 1:
        return SINGLE
    return GroupContext(group, dist.get_rank(group), world, (world,), tuple((r,) for r in range(world)),
                        tuple(dist.get_process_group_ranks(group)))


def stage_context(params: Sequence[Tensor], name_of: Callable[[int], str], group: Any) -> GroupContext:
    """The context of a step over ``group``, a part of the DTensor parameters' root mesh: under
    pipeline parallelism the ranks of one stage (its data, context, tensor and expert-parallel
    ranks), while the mesh spans the other stages too, whose coordinates hold different
    parameters, not replicas (docs/design.md, "Pipeline parallelism").

    Each parameter's pieces come from its mesh's rank layout (`mesh_grid`), restricted to the
    group's ranks: copies of the parameter's mesh inside the group are replicas of it; copies
    outside are never looked at. The group must hold every rank of this rank's copy (the ranks
    holding the other pieces of this rank's parameters).

    Raises:
        ValueError: this rank is not in ``group``, or ``group`` misses a rank holding a piece of
            one of this rank's parameters.
    """
    ranks = tuple(int(r) for r in dist.get_process_group_ranks(group))
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"process_group holds the ranks {list(ranks)} but not this rank ({me}): give each rank "
                         "the group of its own pipeline stage")
    for i, p in enumerate(params):
        if not is_dtensor(p):
            continue
        _, where = mesh_grid(p.device_mesh)
        copy = where[me][0]
        holders = sorted(g for g, c in where.items() if c[0] == copy)
        outside = [g for g in holders if g not in ranks]
        if outside:
            raise ValueError(
                f"{name_of(i)} is split over the ranks {holders} (device mesh {p.device_mesh}) but process_group "
                f"holds {list(ranks)}: the pieces on {outside} would be missing from its whole matrix. Give the "
                "group of every rank of the stage (its data, context, tensor and expert-parallel ranks), or leave "
                "process_group=None without pipeline parallelism"
            )
    world = len(ranks)
    if world == 1:
        return SINGLE
    return GroupContext(group, dist.get_rank(group), world, (world,), tuple((r,) for r in range(world)), ranks)


def _check_local_shape(p: Tensor, name: str) -> None:
    """The local shard must have the shape its placements give, or pieces would be misplaced."""
    mesh = p.device_mesh
    piece = piece_of(p.shape, mesh.shape, mesh.get_coordinate(), p.placements, name)
    got = tuple(p._local_tensor.shape)
    if got != piece_shape(piece):
        raise ValueError(
            f"{name}: this rank holds a shard of shape {got} but the placements {p.placements} of "
            f"{tuple(p.shape)} on a mesh of shape {tuple(mesh.shape)} give {piece_shape(piece)} here; the shards "
            "differ from what the DTensor says. Build the parameter with distribute_tensor / fully_shard / "
            "parallelize_module"
        )
