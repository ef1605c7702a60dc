"""Which rank orthogonalises which matrix: a deterministic plan balanced by flops.

Every matrix is orthogonalised exactly once in the group, on one owner rank (docs/design.md,
"Distributed Muon": never on a shard, never redundantly on every rank). The plan depends only on what every rank
knows identically — the order of the parameters in the optimizer, their global shapes and
their options — so every rank computes the same plan with no communication.

Assignment: longest-processing-time-first. Parameters are sorted by Newton–Schulz flops,
largest first (ties: optimizer order), and each goes to the rank with the least work so far
(ties: the lowest rank). The busiest rank then has at most 4/3 of the optimal makespan
(Graham 1969), and for the usual transformer (many equal matrices) it is balanced to within
one matrix.

The unit is a parameter (a fused QKV weight with ``split_sizes``, contiguous or interleaved
blocks, goes to one owner whole: its shards may cut any block), or, for a stacked-expert weight
``(E, A, B)`` whose shards hold whole experts (expert parallel, ``Shard(0)``), each distinct
piece of experts, owned by one of the ranks that hold it (``allowed``): no data moves to
orthogonalise it.

`plan_step` is the whole plan of a step from what every rank holds of every weight (its
pieces): the units, their owners, and every piece that moves. It takes no process group and no
tensor, so the step (`muonclip.distributed._engine`) and a plan made ahead of any run (``muonclip
plan``) compute it with the same function.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..common._dtensor import Piece, covers, is_empty, piece_shape
from ..optim._matrices import MatrixSpec, matrix_spec
from ._exchange import Transfer


@dataclass(frozen=True)
class Plan:
    """Owner rank of each work item and the flops each rank gets.

    Attributes:
        owners: ``owners[i]`` is the rank that orthogonalises item i.
        flops: Newton–Schulz flops per rank, ``len(flops) == world_size``.
    """

    owners: tuple[int, ...]
    flops: tuple[int, ...]

    def owned(self, rank: int) -> list[int]:
        """Indices of the items ``rank`` orthogonalises, in item order."""
        return [i for i, r in enumerate(self.owners) if r == rank]


def assign_owners(costs: Sequence[int], world_size: int,
                  allowed: Sequence[Sequence[int] | None] | None = None) -> Plan:
    """Give each item (cost ``costs[i]``) to one of ``world_size`` ranks, balancing total cost.

    Args:
        costs: each item's Newton–Schulz flops.
        world_size: ranks in the group.
        allowed: ``allowed[i]`` the ranks item i may go to (None: any; default None for all).
            Expert-parallel pieces go to a rank that holds them, so that no data moves.

    Deterministic: the same arguments give the same plan on every rank. ``world_size == 1``
    gives every item to rank 0.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    load = [0] * world_size
    owners = [0] * len(costs)
    # the least loaded rank of all, lowest first on ties: a heap of (load, rank) holding every rank's
    # current entry (pushed at each change), older entries skipped when they reach the top
    heap = [(0, q) for q in range(world_size)]
    for i in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        ranks = allowed[i] if allowed is not None else None
        if ranks:
            r = min(ranks, key=lambda q: (load[q], q))
        else:
            while heap[0][0] != load[heap[0][1]]:
                heapq.heappop(heap)
            r = heapq.heappop(heap)[1]
        owners[i] = r
        load[r] += costs[i]
        heapq.heappush(heap, (load[r], r))
    return Plan(tuple(owners), tuple(load))


@dataclass(frozen=True)
class PlannedUnit:
    """One unit of work of a step: weight ``k`` whole, or an expert-parallel piece of it.

    Attributes:
        k: the weight (its index in the step).
        piece: the global indices it covers (`muonclip.common._dtensor.Piece`).
        shape: its shape.
        direct: its owner holds it whole, so its V is formed there and nothing is gathered.
        spec: its `muonclip.optim._matrices.MatrixSpec` (the piece's, for an expert piece).
    """

    k: int
    piece: Piece
    shape: tuple[int, ...]
    direct: bool
    spec: MatrixSpec


@dataclass
class StepPlan:
    """The plan of one step over a group: the same on every rank but for ``me``'s own entries.

    Attributes:
        units: the units of work, in plan order.
        owners: the owner rank of each unit (`assign_owners`).
        flops: Newton–Schulz flops per rank (``len == world``).
        gather, gather_unit: the pieces of V that move to owners, and the unit of each.
        scatter, scatter_unit, scatter_piece: the pieces of results that move from owners to
            the other holders, the unit of each and which piece.
        sources: for each unit ``me`` owns and does not hold whole, ``(piece, transfer)`` of
            each piece it is assembled from (transfer None: ``me``'s own).
        mine: per weight ``(unit, transfer)``: where ``me``'s piece of its result comes from
            (transfer None: a unit ``me`` owns; unit None: ``me`` holds nothing of it).
    """

    units: list[PlannedUnit]
    owners: tuple[int, ...]
    flops: tuple[int, ...]
    gather: list[Transfer]
    gather_unit: list[int]
    scatter: list[Transfer]
    scatter_unit: list[int]
    scatter_piece: list[Piece]
    sources: dict[int, list[tuple[Piece, int | None]]]
    mine: list[tuple[int | None, int | None]]

    def owned(self, rank: int) -> list[int]:
        """Indices of the units ``rank`` orthogonalises, in plan order."""
        return [i for i, r in enumerate(self.owners) if r == rank]


Held = Mapping[Piece, Sequence[int]]
"""What the ranks hold of one weight: each distinct piece (equal pieces once, in the order of the
first rank holding each) and the ranks holding it, ascending (`holdings`)."""


def holdings(ranks: Sequence[Piece]) -> dict[Piece, list[int]]:
    """`Held` from every rank's piece of a weight (``ranks[r]``: rank r's; empty pieces included)."""
    held: dict[Piece, list[int]] = {}
    for r, pc in enumerate(ranks):
        held.setdefault(pc, []).append(r)
    return held


def plan_step(groups: Sequence[Mapping[str, Any]], shapes: Sequence[Sequence[int]], specs: Sequence[MatrixSpec],
              pieces: Sequence[Sequence[Piece]], world: int, me: int = 0) -> StepPlan:
    """The plan of a step over ``world`` ranks (identical on every rank: no communication).

    Args:
        groups: each weight's param group (its options: an expert piece's `MatrixSpec` is made
            with them).
        shapes: each weight's global shape.
        specs: each weight's `MatrixSpec`.
        pieces: ``pieces[k][r]``: what rank r holds of weight k (an empty piece: nothing).
        world: ranks in the group.
        me: the rank whose own entries (``sources``, ``mine``) are filled.

    The units: a weight whole, owned by any rank, or, for stacked experts whose every piece holds
    whole experts, each distinct piece, owned by a rank that holds it. Owners by `assign_owners`.
    A unit whose owner holds it whole is ``direct``; any other is assembled on its owner from its
    distinct pieces, each sent by one holder (the ``i % holders``-th, so replicas share the
    sending). Every holder of a piece other than the owner receives that piece of the result.
    The same plan as `plan_held` of the pieces' `holdings`.
    """
    return plan_held(groups, shapes, specs, [holdings(ranks) for ranks in pieces], world, me)


def plan_held(groups: Sequence[Mapping[str, Any]], shapes: Sequence[Sequence[int]], specs: Sequence[MatrixSpec],
              held: Sequence[Held], world: int, me: int = 0) -> StepPlan:
    """`plan_step` from what the ranks hold of each weight as `Held` (``held[k]``), the work done
    once per distinct piece rather than once per rank. Empty pieces may be left out of ``held[k]``
    but for a weight of no element (its whole piece is empty)."""
    found: list[tuple[int, Piece, tuple[int, ...], bool, MatrixSpec]] = []  # (weight, piece, shape, direct, spec)
    allowed: list[Sequence[int] | None] = []
    distinct: list[list[Piece]] = []  # per weight, its non-empty pieces
    for k, g in enumerate(groups):
        shape, h = tuple(shapes[k]), held[k]
        distinct.append([pc for pc in h if not is_empty(pc)])
        if specs[k].experts and all(covers(pc, shape, (1, 2)) for pc in distinct[k]):
            # stacked experts whose every piece holds whole experts: each piece is orthogonalised where it lives
            for pc in distinct[k]:
                found.append((k, pc, piece_shape(pc), True, matrix_spec(piece_shape(pc), g)))
                allowed.append(h[pc])
        else:
            found.append((k, tuple(range(n) for n in shape), shape, False, specs[k]))
            allowed.append(None)
    plan = assign_owners([f[4].flops for f in found], world, allowed)
    found = [(k, pc, shape, direct or plan.owners[i] in held[k].get(pc, ()), spec)  # owner holds it whole (replicas)
             for i, (k, pc, shape, direct, spec) in enumerate(found)]

    gather: list[Transfer] = []
    gather_unit: list[int] = []
    sources: dict[int, list[tuple[Piece, int | None]]] = {}
    scatter: list[Transfer] = []
    scatter_unit: list[int] = []
    scatter_piece: list[Piece] = []
    mine: list[tuple[int | None, int | None]] = [(None, None)] * len(groups)
    for i, (k, piece, _, direct, _) in enumerate(found):
        o, h = plan.owners[i], held[k]
        for pc in [piece] if direct else distinct[k]:
            holders = h[pc]
            shape = piece_shape(pc)
            if not direct:
                if o in holders:
                    transfer = None
                else:
                    transfer = len(gather)
                    gather.append(Transfer(holders[i % len(holders)], o, shape))
                    gather_unit.append(i)
                if o == me:
                    sources.setdefault(i, []).append((pc, transfer))
            for r in holders:
                if r == o:
                    if r == me:
                        mine[k] = (i, None)
                    continue
                if r == me:
                    mine[k] = (i, len(scatter))
                scatter.append(Transfer(o, r, shape))
                scatter_unit.append(i)
                scatter_piece.append(pc)
    units = [PlannedUnit(k, pc, shape, direct, spec) for k, pc, shape, direct, spec in found]
    return StepPlan(units, plan.owners, plan.flops, gather, gather_unit, scatter, scatter_unit, scatter_piece,
                    sources, mine)
