"""Which process group a step runs on, and how each parameter is laid out across it.

`muonclip.distributed.engine` runs one Muon step over a process group (docs/design.md,
"Distributed Muon"). This module answers, once per step, the two questions it needs:

* the group: the device mesh of the DTensor parameters (FSDP2's ``fully_shard``), or, for
  plain tensors, the default group when ``torch.distributed`` is initialised with more than
  one rank (DDP: parameters and gradients are replicated), or no group at all (world size 1,
  the trivial case of the same step);
* the layout of each parameter: ``"replicated"`` (a plain tensor, or a DTensor placed
  ``Replicate()``) or ``"rows"`` (a DTensor placed ``Shard(0)``: each rank holds a contiguous
  block of rows, split like ``torch.chunk``, so rank r's block starts at row
  ``local_rows(p)[1]``).

Anything else is refused with an error that says what to change: a DTensor whose process
group was destroyed, parameters on different meshes, a 2-D mesh (HSDP), a placement other
than ``Shard(0)``/``Replicate()``, a local shard whose shape is not the one ``torch.chunk``
gives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..optim.engine import LOCAL, is_dtensor

REPLICATED = "replicated"
ROWS = "rows"


def local(t: Tensor) -> Tensor:
    """The rank-local tensor: ``t.to_local()`` for a DTensor (an alias: writes go through), else ``t``."""
    if is_dtensor(t):
        return t._local_tensor if not torch.is_grad_enabled() else t.to_local()
    return t


def shard_rows(n_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(row_offset, n_local_rows)`` of ``rank``'s block when ``n_rows`` rows are split like ``torch.chunk``.

    This is how ``Shard(0)`` lays out a DTensor: blocks of ``ceil(n_rows / world_size)`` rows,
    the last ones shorter or empty.
    """
    chunk = -(-n_rows // world_size)  # ceil
    offset = min(rank * chunk, n_rows)
    return offset, min(n_rows, offset + chunk) - offset


def local_rows(param: Tensor) -> tuple[Tensor, int]:
    """``(local_tensor, row_offset)``: the rows of ``param`` this rank holds and where they start.

    A plain tensor or a replicated DTensor: the whole tensor, offset 0. A DTensor split only
    along dim 0 (FSDP2 ``Shard(0)``, also on a 2-D HSDP mesh): its local shard (an alias:
    writes go through) and the global index of its first row, so a per-row factor ``f``
    (indexed by global row) applies as ``local * f[offset : offset + len(local)]``. Used by
    QK-Clip to scale each head's rows where they live (a head's rows may be split between two
    ranks). Raises ValueError for a DTensor split along any other dimension.
    """
    data = param.data if isinstance(param, torch.nn.Parameter) else param
    if not is_dtensor(data):
        return data, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(data.shape, data.device_mesh, data.placements)
    if any(o != 0 for o in offset[1:]) or tuple(shape[1:]) != tuple(data.shape[1:]):
        raise ValueError(
            f"a weight of shape {tuple(data.shape)} placed {data.placements} is split along a dimension other than "
            "the rows; per-row scaling (QK-Clip) needs row shards (Shard(0), what fully_shard uses) or replicas"
        )
    return data._local_tensor, int(offset[0])


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
            if group is None and t.device_mesh.size() > 1:
                group = t.device_mesh.get_group() if t.device_mesh.ndim == 1 else dist.group.WORLD
            t = t._local_tensor
        out.append(t)
    return out, group


def layout_of(t: Tensor, name: str) -> str:
    """``"replicated"`` or ``"rows"`` for a DTensor; raise ValueError naming ``name`` otherwise."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = t.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"{name} lives on a {mesh.ndim}-D device mesh; muonclip.Muon supports 1-D meshes (FSDP2 "
            "fully_shard over one group, or DDP). Flatten the mesh, or use one optimizer per replica group"
        )
    (placement,) = t.placements
    if isinstance(placement, Replicate):
        return REPLICATED
    if isinstance(placement, Shard) and placement.dim == 0:
        return ROWS
    raise ValueError(
        f"{name} is placed {placement}; Muon needs whole matrices and gathers them from row shards "
        "(Shard(0), what fully_shard uses) or replicas only. Shard this parameter on dim 0"
    )


@dataclass(frozen=True)
class GroupContext:
    """The process group of one step: ``group`` None means one process (no collective)."""

    group: Any
    rank: int
    world_size: int


SINGLE = GroupContext(None, 0, 1)


def resolve_group(params: Sequence[Tensor], name_of: Callable[[int], str], process_group: Any = None) -> GroupContext:
    """Find the group the Muon parameters ``params`` live on; validate their layouts.

    Args:
        params: the Muon parameters of the step (plain tensors and/or DTensors).
        name_of: ``name_of(i)`` is a readable name of ``params[i]``, for errors.
        process_group: ``None`` (default, automatic: the DTensors' mesh, else the default
            group when torch.distributed is initialised with world size > 1, else none),
            ``"local"`` (no communication: each process optimises on its own; not allowed with
            sharded DTensors), or a ``ProcessGroup`` for plain replicated tensors.

    Raises:
        RuntimeError: a DTensor parameter is seen while torch.distributed is not initialised.
        ValueError: parameters on different meshes, or a layout Muon cannot handle.
    """
    meshes, first = [], None
    for i, p in enumerate(params):
        if not is_dtensor(p):
            continue
        name = name_of(i)
        if not dist.is_initialized():
            raise RuntimeError(
                f"{name} is a DTensor but torch.distributed is not initialised (was the process group "
                "destroyed?). Call torch.distributed.init_process_group before the optimizer step"
            )
        kind = layout_of(p, name)
        mesh = p.device_mesh
        if first is None:
            first = (mesh, name)
        elif mesh != first[0]:
            raise ValueError(
                f"{name} is on device mesh {mesh} but {first[1]} is on {first[0]}: all Muon parameters of "
                "one optimizer must share one mesh (mixed meshes). Use one optimizer per mesh"
            )
        if kind == ROWS:
            _check_shard_shape(p, name)
        meshes.append(mesh)
    if process_group == LOCAL:
        if meshes and any(m.size() > 1 for m in meshes):
            raise ValueError("process_group='local' cannot be used with parameters sharded over several ranks")
        return SINGLE
    if first is not None:
        group = first[0].get_group()
        if process_group is not None and process_group is not group:
            raise ValueError("process_group differs from the device mesh group of the DTensor parameters")
    elif process_group is not None:
        group = process_group
    elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        group = dist.group.WORLD
    else:
        return SINGLE
    world = dist.get_world_size(group)
    if world == 1:
        return SINGLE
    return GroupContext(group, dist.get_rank(group), world)


def _check_shard_shape(p: Tensor, name: str) -> None:
    mesh = p.device_mesh
    offset, rows = shard_rows(p.shape[0], mesh.size(), mesh.get_local_rank())
    expect = (rows, *p.shape[1:])
    got = tuple(p._local_tensor.shape)
    if got != expect:
        raise ValueError(
            f"{name}: this rank holds a shard of shape {got} but a Shard(0) split of {tuple(p.shape)} over "
            f"{mesh.size()} ranks gives {expect} (rows {offset}..{offset + rows}); the shards differ from what "
            "the DTensor says. Build the parameter with distribute_tensor / fully_shard"
        )


def item_layout(p: Tensor, ctx: GroupContext) -> str:
    """``"rows"`` for a Shard(0) DTensor in a multi-rank step, ``"replicated"`` otherwise."""
    if ctx.world_size > 1 and is_dtensor(p) and p.placements[0].is_shard():
        return ROWS
    return REPLICATED


def row_blocks(n_rows: int, ctx: GroupContext) -> list[tuple[int, int]]:
    """``(offset, rows)`` of every rank's block of a Shard(0) tensor with ``n_rows`` rows."""
    return [shard_rows(n_rows, ctx.world_size, r) for r in range(ctx.world_size)]


__all__ = [
    "GroupContext", "LOCAL", "REPLICATED", "ROWS", "SINGLE", "is_dtensor", "item_layout", "layout_of",
    "local", "local_rows", "locals_and_group", "resolve_group", "row_blocks", "shard_rows",
]
