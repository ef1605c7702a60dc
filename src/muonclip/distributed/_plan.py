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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
    anyone = range(world_size)
    for i in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        ranks = (allowed[i] if allowed is not None else None) or anyone
        r = min(ranks, key=lambda q: (load[q], q))
        owners[i] = r
        load[r] += costs[i]
    return Plan(tuple(owners), tuple(load))
