"""The exchanges of a distributed Muon step (DDP, FSDP2, TP, HSDP, EP), around the core's one step body.

`DistributedEngine` is the `muonclip.optim.multiprocess.Engine` this package registers: the core
optimizer asks it for a step's exchanges when the Muon parameters are shared by more than one
rank (DTensors, or a multi-rank process group; docs/design.md, "Distributed Muon"). A group of
one rank never comes here. The update itself is the core's, in one place
(`muonclip.optim.functional.muon_step`, the same body as in one process); this module supplies
only what moves between ranks, as the body's `muonclip.optim.multiprocess.Exchange`:

1. **Agree** (`DistributedEngine.exchange`, every step): one small all-reduce checks that every
   rank has the same Muon parameters and the same gradients present (`_exchange.agree_parameters`).
2. **Plan** (`StepExchange.plan`, when the step's structure is new): every unit of work (a
   weight, or an expert-parallel piece of one) gets one owner rank, balanced by Newton–Schulz
   flops (`plan.assign_owners`), the same on every rank with no communication; what moves where
   follows. A second all-reduce checks that plain (non-DTensor) parameters hold the same values
   everywhere (`exchange.agree_replicas`: a shard passed as a plain tensor is refused, never
   taken for a replica), and a third that DTensor pieces several ranks hold (the copies of a
   submesh, ``Replicate`` dimensions) hold the same values (`exchange.agree_copies`: the ranks
   of another pipeline stage, which a mesh spanning the stages lays out as copies, are refused,
   never taken for replicas).
3. **Gather** (`StepExchange.gather`, before orthogonalisation): owners get whole V: row-sharded
   ones by one all-to-all (`exchange.exchange`) of the pieces each rank formed from what it
   holds (momentum stays sharded); units held whole by their owner are written straight into
   its bucket by the body.
4. **Scatter** (`StepExchange.scatter`, after): NorMuon's second moments made the same on every
   rank, then an all-to-all of each rank's rows of the results (FSDP2), of the owned results to
   every replica (DDP); the owner's own piece goes through the wire dtype too, so replicas agree
   exactly. The body applies each piece on its rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..common._dtensor import FlatRange, Piece, is_dtensor, is_empty, local, put, repeated, take
from ..optim._buckets import Place, Unit, options_key
from ..optim._matrices import MatrixSpec
from ..optim._state_dicts import state_dtype
from ..optim.functional import FlatPlace, MuonWeight
from ..optim.multiprocess import StepStats, register_engine
from ._context import GroupContext, locals_and_group, resolve_group
from ._exchange import Transfer, agree_copies, agree_parameters, agree_replicas, all_reduce_bytes, exchange, signature
from ._plan import plan_step


class DistributedEngine:
    """The engine `muonclip.distributed` registers (see module docstring)."""

    def context(self, params: Sequence[Tensor], name_of: Callable[[int], str], process_group: Any) -> GroupContext:
        """`muonclip.distributed.resolve_group`: the group, and a clear error for a
        layout Muon cannot handle, before any collective."""
        return resolve_group(params, name_of, process_group)

    def local(self, t: Tensor) -> Tensor:
        """The rank-local tensor (`muonclip.common._dtensor.local`)."""
        return local(t)

    def all_finite(self, tensors: Sequence[Tensor], finite: Tensor, ctx: GroupContext | None = None) -> Tensor:
        """``finite`` AND-ed (one MIN all-reduce) over the ranks of the step's group ``ctx`` (None:
        the mesh of the DTensors among ``tensors``) when there are DTensors among them; unchanged
        for replicated plain tensors (every rank holds the same values)."""
        _, group = locals_and_group(tensors)
        if group is not None and ctx is not None:
            group = ctx.group  # the step's own ranks: under pipeline parallelism, the stage's
        if group is None:
            return finite
        flags = finite.to(torch.int32)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN, group=group)
        return flags.bool()

    def exchange(self, items: Sequence[tuple[dict[str, Any], Tensor, Callable[[], str]]], ctx: GroupContext,
                 comm_dtype: torch.dtype | None, stats: StepStats) -> StepExchange:
        """The step's `StepExchange`, after one all-reduce checks that every rank has the same Muon
        parameters (``items``: all of them, as ``(group, param, name)``, in optimizer order: the
        order fixes the plan; ``name()`` is called only for an error) and the same gradients
        present. ``comm_dtype``: wire dtype of the exchanges (None: the momentum dtype)."""
        if items:
            sig = signature([(tuple(p.shape), p.dtype, str(getattr(p, "placements", "")), ctx.mesh_shape,
                              *options_key(g)) for g, p, _ in items])
            agree_parameters(ctx, sig, [p.grad is not None for _, p, _ in items], [n for _, _, n in items],
                  local(items[0][1]).device, stats.comm)
        return StepExchange(ctx, comm_dtype, stats)


class StepExchange:
    """The exchanges of one step over the group of ``ctx`` (`muonclip.optim.multiprocess.Exchange`;
    module docstring), collectives counted in ``stats.comm``."""

    def __init__(self, ctx: GroupContext, comm_dtype: torch.dtype | None, stats: StepStats) -> None:
        self.ctx, self.comm_dtype, self.stats = ctx, comm_dtype, stats

    def key(self, params: Sequence[Tensor]) -> tuple:
        """The group, the rank and each parameter's placements, mesh and local device."""
        ctx = self.ctx
        return (ctx.world_size, ctx.rank, ctx.mesh_shape, ctx.coords,
                tuple((str(getattr(p, "placements", "")), getattr(p, "device_mesh", None), local(p).device)
                      for p in params))

    def plan(self, live: Sequence[tuple[dict[str, Any], Tensor]], names: Sequence[Callable[[], str]],
             specs: Sequence[MatrixSpec]) -> Routes:
        """`Routes` of the weights ``live``; then plain tensors must really be replicas (never a
        shard taken for one): one all-reduce of their fingerprints."""
        routes = _build(live, names, specs, self.ctx)
        if not getattr(self.ctx, "plain_replicas", True):  # a context whose plain tensors are partitions
            return routes
        plain = [k for k, (_, p) in enumerate(live) if not is_dtensor(p)]
        device = local(live[0][1]).device
        agree_replicas(self.ctx, [live[k][1] for k in plain], [names[k]() for k in plain], device, self.stats.comm)
        shared = [k for k, (_, p) in enumerate(live) if is_dtensor(p) and repeated(routes.all_pieces[k])]
        agree_copies(self.ctx, [live[k][1] for k in shared], [routes.all_pieces[k] for k in shared],
                     [names[k] for k in shared], device, self.stats.comm)
        return routes

    def gather(self, routes: Routes, weights: Sequence[MuonWeight], v_of: Callable[[int], Tensor]) -> dict[int, Tensor]:
        """The whole V of every unit this rank owns and does not hold whole, assembled from its
        pieces: this rank's own (``v_of``) and the others' (one all-to-all)."""
        dtype, device = state_dtype(weights[0].param), weights[0].grad.device
        whole: dict[int, Tensor] = {}
        if not routes.gather:
            return whole
        got = exchange(self.ctx, routes.gather, lambda j: v_of(routes.units[routes.gather_unit[j]].k),
                       self.comm_dtype or dtype, device, self.stats.comm)
        for u in routes.owned:
            unit = routes.units[u]
            if unit.direct:
                continue
            t = torch.empty(routes.shapes[u], dtype=dtype, device=device)
            for piece, j in routes.sources[u]:
                put(t, piece, v_of(unit.k) if j is None else got[j].to(dtype), within=routes.unit_pieces[u])
            whole[u] = t
        return whole

    def scatter(self, routes: Routes, results: dict[int, Tensor],
                weights: Sequence[MuonWeight]) -> list[tuple[int, Tensor]]:
        """NorMuon's second moments made the same on every rank (`share_second_moments`), then this
        rank's piece of every weight's result, from its owner (one all-to-all), in the momentum
        dtype."""
        seconds = [w.second_moment for w in weights]
        if any(v is not None for v in seconds):
            share_second_moments(self.ctx, routes, seconds, self.stats)
        dtype, device = state_dtype(weights[0].param), weights[0].grad.device
        wire = self.comm_dtype or dtype
        got = {}
        if routes.scatter:
            got = exchange(self.ctx, routes.scatter,
                           lambda j: take(results[routes.scatter_unit[j]], routes.scatter_piece[j],
                                          within=routes.unit_pieces[routes.scatter_unit[j]]),
                           wire, device, self.stats.comm)
        out = []
        for k, (u, j) in enumerate(routes.mine):
            if u is None:  # this rank holds nothing of weight k (an uneven split)
                continue
            if j is None:  # from a unit this rank owns: through the wire dtype too, so replicas agree exactly
                out.append((k, take(results[u], routes.pieces[k], within=routes.unit_pieces[u]).to(wire).to(dtype)))
            else:
                out.append((k, got[j].to(dtype)))
        return out


def share_second_moments(ctx: GroupContext, routes: Routes, seconds: Sequence[Tensor | None], stats: StepStats) -> None:
    """NorMuon's second moments after a step, the same on every rank: each unit's rows were
    updated by its owner only; one SUM all-reduce of every unit's rows (the owner's values, zeros
    from the other ranks: exact) gives every rank the owners' values."""
    parts = [(u, seconds[unit.k][unit.experts]) for u, unit in enumerate(routes.units) if seconds[unit.k] is not None]
    flat = torch.cat([v.reshape(-1) if routes.owners[u] == ctx.rank else torch.zeros_like(v).reshape(-1)
                      for u, v in parts])
    dist.all_reduce(flat, group=ctx.group)
    stats.comm.add("all_reduce", all_reduce_bytes(flat.numel() * flat.element_size(), ctx.world_size))
    for (_, v), got in zip(parts, flat.split([v.numel() for _, v in parts])):
        v.copy_(got.view(v.shape))


@dataclass
class Routes:
    """A step's plan over the group (`muonclip.optim.multiprocess.Routes`): the units, who owns
    them and what moves where; the same on every rank but for this rank's own entries.

    Attributes:
        units: the units of work (`muonclip.optim._buckets.Unit`).
        owned: the units this rank orthogonalises.
        places: per weight, where this rank's piece of its result applies.
        flops, total_flops: Newton–Schulz flops of this rank's units and of all.
        owners: the owner rank of each unit (`plan.assign_owners`).
        unit_pieces, shapes: the global indices each unit covers (the whole parameter, or an
            expert-parallel piece), and its shape.
        pieces: this rank's piece of each weight.
        gather, gather_unit: the pieces of V that move to owners, and the unit each belongs to.
        sources: per owned unit, ``(piece, transfer)`` for each piece it is assembled from
            (transfer None: this rank's own).
        scatter, scatter_unit, scatter_piece: the pieces of results that move from owners.
        mine: per weight ``(unit, transfer)``: where this rank's piece of the result comes from
            (transfer None: a unit this rank owns; unit None: this rank holds nothing).
        all_pieces: per weight, every group rank's piece.
    """

    units: list[Unit]
    owned: list[int]
    places: list[Place]
    flops: int
    total_flops: int
    owners: tuple[int, ...]
    unit_pieces: list[Piece]
    shapes: list[tuple[int, ...]]
    pieces: list[Piece]
    gather: list[Transfer]
    gather_unit: list[int]
    sources: dict[int, list[tuple[Piece, int | None]]]
    scatter: list[Transfer]
    scatter_unit: list[int]
    scatter_piece: list[Piece]
    mine: list[tuple[int | None, int | None]]
    all_pieces: list[list[Piece]]


def _experts(spec: MatrixSpec, piece: Piece) -> slice:
    """The experts (rows of a per-expert buffer) a unit covers: those of its piece for a
    stacked-expert weight, else all."""
    first = piece[0]
    if spec.experts and isinstance(first, range) and first.step == 1:
        return slice(first.start, first.stop)
    return slice(None)


def _build(live: Sequence[tuple[dict[str, Any], Tensor]], names: Sequence[Callable[[], str]],
           specs: Sequence[MatrixSpec], ctx: GroupContext) -> Routes:
    """Plan a step: units, owners, what moves where (`plan.plan_step`, from every rank's pieces:
    identical on every rank, no communication), and where this rank's pieces apply."""
    me = ctx.rank
    all_pieces = []
    for k, (g, p) in enumerate(live):
        pieces = ctx.pieces(p, names[k]())
        all_pieces.append(pieces)
        if g["momentum_8bit"]:
            _check_whole_rows(p, specs[k], pieces, names[k])
    sp = plan_step([g for g, _ in live], [tuple(p.shape) for _, p in live], specs, all_pieces, ctx.world_size, me)
    places: list[Place] = []
    for k, (_, p) in enumerate(live):
        axis, ranges = specs[k].axis, specs[k].ranges
        mine_k = all_pieces[k][me]
        if isinstance(mine_k, FlatRange):  # elements of the flattened weight (DeepSpeed ZeRO)
            places.append((axis, ranges, FlatPlace(mine_k.start, tuple(p.shape))))
            continue
        index = mine_k[axis]
        if isinstance(index, range):
            places.append((axis, ranges, index.start if len(index) else 0))
        elif len({s for _, _, s in ranges}) == 1:
            places.append((axis, ((0, len(index), ranges[0][2]),), 0))
        else:
            raise ValueError(
                f"{names[k]()}: this rank's shard holds non-contiguous rows of matrix blocks with different update "
                f"scales (placements {getattr(p, 'placements', None)}); shard it so that each rank holds a "
                "contiguous block of rows, or keep the weight whole (split_fused=False)"
            )
    units = [Unit(u.k, u.spec, _experts(u.spec, u.piece), u.direct) for u in sp.units]
    return Routes(units, sp.owned(me), places, sp.flops[me], sum(sp.flops), sp.owners,
                  [u.piece for u in sp.units], [u.shape for u in sp.units],
                  [all_pieces[k][me] for k in range(len(live))], sp.gather, sp.gather_unit, sp.sources, sp.scatter,
                  sp.scatter_unit, sp.scatter_piece, sp.mine, all_pieces)


def _check_whole_rows(p: Tensor, spec: MatrixSpec, pieces: Sequence[Piece], name: Callable[[], str]) -> None:
    """8-bit momentum quantises blocks of a row (`muonclip.optim._quantized`): refuse a layout
    whose pieces cut rows (sharded along the last dimension; a flattened weight: along any but the
    first)."""
    row_dims = range(1, p.ndim) if spec.flatten or p.ndim >= 4 else (p.ndim - 1,)
    for pc in pieces:
        if is_empty(pc):
            continue
        if isinstance(pc, FlatRange):
            raise ValueError(
                f"{name()}: momentum_8bit keeps one scale per block of a row, and this parameter is partitioned into "
                "ranges of its flattened elements (DeepSpeed ZeRO), which cut its rows; put it in a param group with "
                "momentum_8bit=False"
            )
        for d in row_dims:
            if list(pc[d]) != list(range(p.shape[d])):
                raise ValueError(
                    f"{name()}: momentum_8bit keeps one scale per block of a row, and this parameter is sharded "
                    f"along dimension {d} (placements {getattr(p, 'placements', None)}), which cuts its rows; shard "
                    "it along its first dimension (FSDP2 does), or put it in a param group with momentum_8bit=False"
                )


register_engine(DistributedEngine())
