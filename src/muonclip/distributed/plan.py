"""Which rank orthogonalises which matrix: a deterministic plan balanced by flops.

Every matrix is orthogonalised exactly once in the group, on one owner rank (design.md 1.4:
never on a shard, never redundantly on every rank). The plan depends only on what every rank
knows identically — the order of the parameters in the optimizer, their global shapes and
their options — so every rank computes the same plan with no communication.

Assignment: longest-processing-time-first. Parameters are sorted by Newton–Schulz flops,
largest first (ties: optimizer order), and each goes to the rank with the least work so far
(ties: the lowest rank). The busiest rank then has at most 4/3 of the optimal makespan
(Graham 1969), and for the usual transformer (many equal matrices) it is balanced to within
one matrix.

The unit is a parameter: a stacked-expert weight ``(E, A, B)`` or a fused QKV weight with
``split_sizes`` (contiguous or interleaved blocks) goes to one owner whole, because FSDP2 shards
it by rows and the owner needs all its rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..optim.matrices import block_rows


def ns_flops(blocks: Sequence[tuple[int, int, int]], steps: int) -> int:
    """Flops of ``steps`` quintic Newton–Schulz iterations on matrix blocks ``(E, A, B)``.

    Per matrix, with ``m = min(A, B)``, ``n = max(A, B)``: one step costs ``4 m^2 n + 2 m^3``
    (``X X^T``: ``2 m^2 n``; ``S S``: ``2 m^3``; ``P X``: ``2 m^2 n``), design.md 1.2.
    """
    total = 0
    for E, A, B in blocks:
        m, n = min(A, B), max(A, B)
        total += E * steps * (4 * m * m * n + 2 * m**3)
    return total


def matrix_rows(
    shape: Sequence[int], flatten: bool = False, split_sizes: Sequence[int] | None = None,
    transposed: bool = False, split_groups: int = 1,
) -> tuple[int, list[list[tuple[int, int]]], int, int]:
    """How a parameter of global ``shape`` is cut into matrices, stated as row ranges.

    Mirrors `muonclip.optim.matrices.matrix_blocks` without touching data, so that a rank
    holding only some rows (FSDP2) knows which matrix block each of its rows belongs to.

    Returns:
        ``(axis, blocks, cols, batch)``: block k is the rows ``blocks[k]`` (half-open ranges
        ``[a, b)``, one per group of an interleaved layout, in group order; one range
        otherwise) along ``axis`` of the parameter (0 for 2-D and flattened weights, 1 for
        stacked experts ``(E, A, B)`` and for ``transposed`` 2-D weights stored ``(in, out)``,
        whose matrix rows are the stored columns, 2 for ``transposed`` stacked experts
        ``(E, in, out)``); each block has ``cols`` columns and ``batch`` matrices (E for
        stacked experts, else 1).
    """
    if transposed:
        axis, rows, cols = len(shape) - 1, shape[-1], shape[-2]
        batch = shape[0] if len(shape) == 3 else 1
    elif flatten or len(shape) >= 4 or len(shape) == 2:
        axis, rows, batch = 0, shape[0], 1
        cols = 1
        for s in shape[1:]:
            cols *= s
    else:
        axis, batch, rows, cols = 1, shape[0], shape[1], shape[2]
    return axis, block_rows(rows, split_sizes, split_groups), cols, batch


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


def assign_owners(costs: Sequence[int], world_size: int) -> Plan:
    """Give each item (cost ``costs[i]``) to one of ``world_size`` ranks, balancing total cost.

    Deterministic: the same ``costs`` give the same plan on every rank. ``world_size == 1``
    gives every item to rank 0.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    load = [0] * world_size
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        r = min(range(world_size), key=lambda q: (load[q], q))
        owners[i] = r
        load[r] += costs[i]
    return Plan(tuple(owners), tuple(load))


__all__ = ["Plan", "assign_owners", "matrix_rows", "ns_flops"]
