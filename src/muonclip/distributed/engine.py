"""The distributed Muon step: the core's update phases over a process group (DDP, FSDP2, TP, HSDP, EP).

`DistributedEngine` is the `muonclip.optim.distribution.Engine` this package registers: the core
optimizer hands it a step when the Muon parameters are shared by more than one rank (DTensors,
or a multi-rank process group; docs/design.md, "Distributed Muon"). A group of one rank never
comes here: the core runs that step itself (`muonclip.optim.functional.muon_step`, on each
rank-local tensor). The phases, each run by every rank:

1. **Agree**: one small all-reduce checks that every rank has the same Muon parameters and the
   same gradients present (`exchange.agree`); when the step's structure is new, a second one
   checks that plain (non-DTensor) parameters hold the same values everywhere
   (`exchange.agree_replicas`: a shard passed as a plain tensor is refused, never taken for a replica).
2. **Momentum** (`muonclip.optim.functional.momentum_`) on what each rank holds, each weight's
   just before its V is formed (`muon_input`). Under FSDP2 ``M``, ``G`` and ``V`` are row
   shards: momentum stays sharded.
3. **Plan**: every weight gets one owner rank, balanced by Newton–Schulz flops
   (`plan.assign_owners`); the same on every rank, no communication.
4. **Gather** (exchange): owners get whole V: row-sharded ones by one all-to-all
   (`exchange.exchange`); replicated ones are already whole and written straight into the
   owner's bucket.
5. **Orthogonalise** on the owner only, on whole matrices, one call per bucket of same-shape
   blocks (`muonclip.optim.buckets`, the core's buckets).
6. **Scatter** (exchange): results go back: an all-to-all of each rank's rows (FSDP2), of the
   owned results to every replica (DDP).
7. **Apply** (`muonclip.optim.functional.apply_blocks_`) on each rank's own rows.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..common.dtensor import Piece, covers, is_dtensor, is_empty, local, piece_shape, put, take
from ..optim.buckets import Bucket, Results, make_buckets, options_key
from ..optim.distribution import StepStats, register_engine
from ..optim.functional import apply_blocks_, muon_input, neuron_moment, normuon_bucket_, step_momentum
from ..optim.matrices import MatrixSpec, matrix_spec
from ..optim.state_dicts import state_dtype
from ..optim.validation import number
from ..optim.weight_state import momentum_state, second_moment_state
from .context import GroupContext, locals_and_group, resolve_group
from .exchange import Transfer, agree, agree_replicas, exchange, signature
from .plan import Plan, assign_owners

_KEPT_STRUCTURES = 8  # step structures kept (least recently used dropped)


class DistributedEngine:
    """The engine `muonclip.distributed` registers (see module docstring)."""

    def __init__(self) -> None:
        self._structures: OrderedDict[tuple, _Routes] = OrderedDict()  # a few, for several optimizers

    def context(self, params: Sequence[Tensor], name_of: Callable[[int], str], process_group: Any) -> GroupContext:
        """`muonclip.distributed.context.resolve_group`: the group, and a clear error for a
        layout Muon cannot handle, before any collective."""
        return resolve_group(params, name_of, process_group)

    def local(self, t: Tensor) -> Tensor:
        """The rank-local tensor (`muonclip.common.dtensor.local`)."""
        return local(t)

    def all_finite(self, tensors: Sequence[Tensor], finite: Tensor) -> Tensor:
        """``finite`` AND-ed (one MIN all-reduce) over the mesh of the DTensors among ``tensors``;
        unchanged for replicated plain tensors (every rank holds the same values)."""
        _, group = locals_and_group(tensors)
        if group is None:
            return finite
        flags = finite.to(torch.int32)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN, group=group)
        return flags.bool()

    def muon_step(self, items: Sequence[tuple[dict[str, Any], Tensor, Callable[[], str]]],
                  state: dict[Tensor, dict[str, Any]], ctx: GroupContext, *, backend: Any,
                  new_buffer: Callable[[Tensor], Tensor], comm_dtype: torch.dtype | None) -> StepStats:
        """Apply one Muon update to every item with a gradient (see module docstring).

        Args:
            items: every Muon parameter of the optimizer, with or without a gradient, as
                ``(group, param, name)`` in optimizer order (the order fixes the plan; ``name()``
                is called only for an error).
            state: the optimizer's per-parameter state; ``"momentum_buffer"`` is created with
                ``new_buffer(param)`` (a DTensor for a DTensor parameter, so checkpoints reshard).
            ctx: the group (`context`), of more than one rank.
            backend: the optimizer's backend (`muonclip.optim.backend`).
            new_buffer: makes a parameter's momentum buffer.
            comm_dtype: wire dtype of the exchanges (None: the momentum dtype).
        """
        stats = StepStats(world_size=ctx.world_size)
        if not items:
            return stats
        # 1. agree
        sig = signature([(tuple(p.shape), p.dtype, str(getattr(p, "placements", "")), ctx.mesh_shape,
                          *options_key(g)) for g, p, _ in items])
        agree(ctx, sig, [p.grad is not None for _, p, _ in items], [n() for _, _, n in items],
              local(items[0][1]).device, stats.comm)
        live = [(g, p) for g, p, _ in items if p.grad is not None]
        if not live:
            return stats
        names = [n for _, p, n in items if p.grad is not None]
        grads = [local(p.grad) for _, p in live]
        st, new = self._cached_structure(live, names, ctx)
        specs = [matrix_spec(p.shape, g) for g, p in live]
        momenta = [momentum_state(state[p], p, g, spec, local, new_buffer) for (g, p), spec in zip(live, specs)]
        seconds = [second_moment_state(state[p], p, g, spec) for (g, p), spec in zip(live, specs)]
        if new:  # plain tensors must really be replicas (never a shard taken for one)
            plain = [k for k, (_, p) in enumerate(live) if not is_dtensor(p)]
            agree_replicas(ctx, [live[k][1] for k in plain], [names[k]() for k in plain], device_of(live), stats.comm)
        plan, me = st.plan, ctx.rank
        stats.total_ns_flops, stats.ns_flops = sum(plan.flops), plan.flops[me]
        dtype, device = state_dtype(live[0][1]), grads[0].device
        wire = comm_dtype or dtype

        # 2. momentum, once per weight, just before its V is formed (8-bit: dequantised, and back)
        fresh = set(range(len(live)))
        bufs: dict[int, Tensor] = {}

        def momentum(k: int) -> Tensor:
            if k in fresh:
                fresh.discard(k)
                bufs[k] = step_momentum(grads[k], live[k][0]["momentum"], *momenta[k])
            return bufs[k]

        v_cache: dict[int, Tensor] = {}

        def my_v(k: int) -> Tensor:
            """This rank's piece of weight k's V (momentum first)."""
            if k not in v_cache:
                g = live[k][0]
                v_cache[k] = muon_input(grads[k], momentum(k), g["momentum"], g["nesterov"])
            return v_cache[k]

        # 4. gather: whole V of the units this rank owns and does not hold whole
        whole: dict[int, Tensor] = {}
        if st.gather:
            got = exchange(ctx, st.gather, lambda j: my_v(st.units[st.gather_unit[j]].k), wire, device, stats.comm)
            for u in plan.owned(me):
                unit = st.units[u]
                if unit.direct:
                    continue
                t = torch.empty(unit.shape, dtype=dtype, device=device)
                for piece, j in st.sources[u]:
                    put(t, piece, my_v(unit.k) if j is None else got[j].to(dtype), within=unit.piece)
                whole[u] = t

        # 5. orthogonalise the owned units, one call per bucket (the core's buckets and phases)
        results: dict[int, Tensor] = {}
        collect = Results([u.spec for u in st.units], reuse_result=False)
        for bucket in st.buckets:
            V = bucket.empty(backend)
            for u, b, slot in bucket.slots(V):
                unit = st.units[u]
                if u in whole:  # assembled from pieces
                    slot.copy_(unit.spec.block(whole[u], b))
                else:  # held whole here: V straight into the bucket
                    g = live[unit.k][0]
                    muon_input(unit.spec.block(grads[unit.k], b), unit.spec.block(momentum(unit.k), b),
                               g["momentum"], g["nesterov"], out=slot)
            O = bucket.orthogonalize(V, backend, reuse_result=False)
            normuon_bucket_(bucket, O, lambda u, b: neuron_moment(
                seconds[st.units[u].k], st.units[u].spec, b, live[st.units[u].k][0]["normuon_beta2"],
                experts=st.units[u].experts))
            results.update(collect.of(bucket, O))
            stats.matrices += V.shape[0]
        for k in sorted(fresh):  # momentum of the weights this rank neither owns nor sends
            momentum(k)
        if any(v is not None for v in seconds):  # NorMuon: every rank gets the owners' second moments
            share_second_moments(ctx, st, seconds, stats)

        # 6. scatter: each rank's piece of every result, from its owner; 7. apply
        got = {}
        if st.scatter:
            got = exchange(ctx, st.scatter,
                           lambda j: take(results[st.scatter_unit[j]], st.scatter_piece[j],
                                          within=st.units[st.scatter_unit[j]].piece), wire, device, stats.comm)
        for k, (u, j) in enumerate(st.mine):
            if u is None:  # this rank holds nothing of weight k (an uneven split)
                continue
            if j is None:  # from a unit this rank owns: through the wire dtype too, so replicas agree exactly
                O = take(results[u], st.pieces[k], within=st.units[u].piece).to(wire).to(dtype)
            else:
                O = got[j].to(dtype)
            g, p = live[k]
            axis, ranges, offset = st.scales[k]
            apply_blocks_(local(p), O, lr=number(g["lr"]), weight_decay=number(g["weight_decay"]), axis=axis,
                          ranges=ranges, offset=offset, cautious=g["cautious_weight_decay"])
        return stats

    def _cached_structure(self, live: list[tuple[dict[str, Any], Tensor]], names: list[Callable[[], str]],
                          ctx: GroupContext) -> tuple[_Routes, bool]:
        """The step's `_Routes` and whether they are new: rebuilt only when the items' global shapes,
        placements, meshes, devices, structural options, the rank or the group changed."""
        key = (ctx.world_size, ctx.rank, ctx.mesh_shape, ctx.coords,
               tuple((options_key(g), tuple(p.shape), str(getattr(p, "placements", "")),
                      getattr(p, "device_mesh", None), local(p).device) for g, p in live))
        if key in self._structures:
            self._structures.move_to_end(key)
            return self._structures[key], False
        st = _build(live, names, ctx)
        self._structures[key] = st
        if len(self._structures) > _KEPT_STRUCTURES:
            self._structures.popitem(last=False)
        return st, True


def share_second_moments(ctx: GroupContext, st: _Routes, seconds: Sequence[Tensor | None], stats: StepStats) -> None:
    """NorMuon's second moments after a step, the same on every rank: each unit's rows were
    updated by its owner only; one SUM all-reduce of every unit's rows (the owner's values, zeros
    from the other ranks: exact) gives every rank the owners' values."""
    parts = [(u, seconds[unit.k][unit.experts]) for u, unit in enumerate(st.units) if seconds[unit.k] is not None]
    flat = torch.cat([v.reshape(-1) if st.plan.owners[u] == ctx.rank else torch.zeros_like(v).reshape(-1)
                      for u, v in parts])
    dist.all_reduce(flat, group=ctx.group)
    stats.comm.add("all_reduce", 2 * flat.numel() * flat.element_size() * (ctx.world_size - 1) // ctx.world_size)
    for (_, v), got in zip(parts, flat.split([v.numel() for _, v in parts])):
        v.copy_(got.view(v.shape))


def device_of(live: list[tuple[dict[str, Any], Tensor]]) -> torch.device:
    """The device of the first item's local tensor (where the step's small collectives run)."""
    return local(live[0][1]).device


@dataclass(frozen=True)
class _Unit:
    """What one owner orthogonalises in one piece of work.

    Attributes:
        k: the item (parameter) it belongs to.
        piece: the global indices it covers (the whole parameter, or an expert-parallel piece).
        shape: its shape (the parameter's global shape, or the piece's).
        direct: the owner holds all of it locally (its V is written straight into the bucket).
        spec: its `muonclip.optim.matrices.MatrixSpec`.
    """

    k: int
    piece: Piece
    shape: tuple[int, ...]
    direct: bool
    spec: MatrixSpec

    @property
    def experts(self) -> slice:
        """The experts (rows of a per-expert buffer) this unit covers: those of its piece for
        a stacked-expert weight, else all."""
        first = self.piece[0]
        if self.spec.experts and isinstance(first, range) and first.step == 1:
            return slice(first.start, first.stop)
        return slice(None)


@dataclass
class _Routes:
    """What a step does that depends only on its items' shapes, options and placements.

    Attributes:
        plan: owner rank of each unit (`plan.assign_owners`).
        units: the units of work (`_Unit`).
        pieces: this rank's piece of each item.
        gather, gather_unit: the pieces of V that move to owners, and the unit each belongs to.
        sources: per owned unit, ``(piece, transfer)`` for each piece it is assembled from
            (transfer None: this rank's own).
        scatter, scatter_unit, scatter_piece: the pieces of results that move from owners.
        mine: per item ``(unit, transfer)``: where this rank's piece of the result comes from
            (transfer None: a unit this rank owns; unit None: this rank holds nothing).
        scales: per item ``(axis, ranges, offset)`` for `apply_blocks_` on this rank's piece.
        buckets: the owned units' buckets (`muonclip.optim.buckets.make_buckets`).
    """

    plan: Plan
    units: list[_Unit]
    pieces: list[Piece]
    gather: list[Transfer]
    gather_unit: list[int]
    sources: dict[int, list[tuple[Piece, int | None]]]
    scatter: list[Transfer]
    scatter_unit: list[int]
    scatter_piece: list[Piece]
    mine: list[tuple[int | None, int | None]]
    scales: list[tuple[int, tuple[tuple[int, int, float], ...], int]]
    buckets: list[Bucket]


def _build(live: list[tuple[dict[str, Any], Tensor]], names: list[Callable[[], str]], ctx: GroupContext) -> _Routes:
    """Plan a step: units, owners, what moves where (identical on every rank: no communication)."""
    me, world = ctx.rank, ctx.world_size
    units: list[_Unit] = []
    allowed: list[list[int] | None] = []
    all_pieces = []
    specs = [matrix_spec(p.shape, g) for g, p in live]
    for k, (g, p) in enumerate(live):
        pieces = ctx.pieces(p, names[k]())
        all_pieces.append(pieces)
        if g["momentum_8bit"]:
            _check_whole_rows(p, specs[k], pieces, names[k])
        distinct = list(dict.fromkeys(pc for pc in pieces if not is_empty(pc)))
        full = tuple(range(n) for n in p.shape)
        if specs[k].experts and all(covers(pc, p.shape, (1, 2)) for pc in distinct):
            # stacked experts whose every piece holds whole experts: each piece is orthogonalised where it lives
            for pc in distinct:
                holders = [r for r in range(world) if pieces[r] == pc]
                units.append(_Unit(k, pc, piece_shape(pc), True, matrix_spec(piece_shape(pc), g)))
                allowed.append(holders)
        else:
            units.append(_Unit(k, full, tuple(p.shape), False, specs[k]))
            allowed.append(None)
    plan = assign_owners([u.spec.flops for u in units], world, allowed)
    units = [u if u.direct or all_pieces[u.k][plan.owners[i]] != u.piece else
             _Unit(u.k, u.piece, u.shape, True, u.spec) for i, u in enumerate(units)]  # owner holds it whole (replicas)

    gather: list[Transfer] = []
    gather_unit: list[int] = []
    sources: dict[int, list[tuple[Piece, int | None]]] = {}
    scatter: list[Transfer] = []
    scatter_unit: list[int] = []
    scatter_piece: list[Piece] = []
    mine: list[tuple[int | None, int | None]] = [(None, None)] * len(live)
    for i, u in enumerate(units):
        o, pieces = plan.owners[i], all_pieces[u.k]
        needed = [u.piece] if u.direct else list(dict.fromkeys(pc for pc in pieces if not is_empty(pc)))
        for pc in needed:
            holders = [r for r in range(world) if pieces[r] == pc]
            if not u.direct:
                if o in holders:
                    transfer = None
                else:
                    transfer = len(gather)
                    gather.append(Transfer(holders[i % len(holders)], o, piece_shape(pc)))
                    gather_unit.append(i)
                if o == me:
                    sources.setdefault(i, []).append((pc, transfer))
            for h in holders:
                if h == o:
                    if h == me:
                        mine[u.k] = (i, None)
                    continue
                if h == me:
                    mine[u.k] = (i, len(scatter))
                scatter.append(Transfer(o, h, piece_shape(pc)))
                scatter_unit.append(i)
                scatter_piece.append(pc)

    scales = []
    for k, (_, p) in enumerate(live):
        axis, ranges = specs[k].axis, specs[k].ranges
        index = all_pieces[k][me][axis]
        if isinstance(index, range):
            scales.append((axis, ranges, index.start if len(index) else 0))
        elif len({s for _, _, s in ranges}) == 1:
            scales.append((axis, ((0, len(index), ranges[0][2]),), 0))
        else:
            raise ValueError(
                f"{names[k]()}: this rank's shard holds non-contiguous rows of matrix blocks with different update "
                f"scales (placements {getattr(p, 'placements', None)}); shard it so that each rank holds a "
                "contiguous block of rows, or keep the weight whole (split_fused=False)"
            )
    buckets = make_buckets([u.spec for u in units], [live[u.k][0] for u in units],
                           [local(live[u.k][1]).device for u in units], plan.owned(me))
    return _Routes(plan, units, [all_pieces[k][me] for k in range(len(live))], gather, gather_unit, sources,
                   scatter, scatter_unit, scatter_piece, mine, scales, buckets)


def _check_whole_rows(p: Tensor, spec: MatrixSpec, pieces: Sequence[Piece], name: Callable[[], str]) -> None:
    """8-bit momentum quantises blocks of a row (`muonclip.optim.quantized`): refuse a layout
    whose pieces cut rows (sharded along the last dimension; a flattened weight: along any but the
    first)."""
    row_dims = range(1, p.ndim) if spec.flatten or p.ndim >= 4 else (p.ndim - 1,)
    for pc in pieces:
        if is_empty(pc):
            continue
        for d in row_dims:
            if list(pc[d]) != list(range(p.shape[d])):
                raise ValueError(
                    f"{name()}: momentum_8bit keeps one scale per block of a row, and this parameter is sharded "
                    f"along dimension {d} (placements {getattr(p, 'placements', None)}), which cuts its rows; shard "
                    "it along its first dimension (FSDP2 does), or put it in a param group with momentum_8bit=False"
                )


register_engine(DistributedEngine())

__all__ = ["DistributedEngine"]
