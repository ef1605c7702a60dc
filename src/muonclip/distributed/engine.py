"""The distributed Muon step: the core's update phases over a process group (DDP, FSDP2).

`DistributedEngine` is the `muonclip.optim.engine.Engine` this package registers: the core
optimizer hands it a step when the parameters are DTensors or a multi-rank process group is
in use (docs/design.md, "Distributed Muon"). Phases, each run by every rank (collectives only
when the group has more than one rank):

1. **Agree**: one small all-reduce checks that every rank has the same Muon parameters and the
   same gradients present (`exchange.agree`).
2. **Momentum** on what each rank holds (`muonclip.optim.functional.momentum_`), each weight's
   just before its V is formed. Under FSDP2 ``M``, ``G`` and ``V`` are row shards: momentum
   stays sharded.
3. **Plan**: every weight gets one owner rank, balanced by Newton–Schulz flops
   (`plan.assign_owners`); the same on every rank, no communication.
4. **Gather**: owners get whole V: row-sharded ones by one all-to-all (`exchange.gather_rows`);
   replicated ones are already whole and written straight into the owner's bucket.
5. **Orthogonalise** on the owner only, on whole matrices, one call per bucket of same-shape
   blocks (`muonclip.optim.buckets.orthogonalize_buckets`, the core's).
6. **Exchange**: results go back — all-to-all of each rank's rows (FSDP2), all-gather of the
   owned results (DDP).
7. **Apply** (`muonclip.optim.functional.apply_blocks_`) on each rank's own rows.

A group of one rank is the trivial case: every weight is owned by rank 0, phases 1, 4 and 6
have nothing to do, and each weight is updated as soon as its bucket is done, exactly as the
core's one-process step does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..optim.buckets import (
    item_flops,
    item_scales,
    make_buckets,
    matrix_options,
    options_key,
    orthogonalize_buckets,
)
from ..optim.engine import StepStats, register_engine
from ..optim.functional import apply_blocks_, momentum_, muon_input
from ..optim.matrices import block_views
from .context import ROWS, GroupContext, item_layout, local, locals_and_group, resolve_group, shard_rows
from .exchange import agree, all_gather_owned, gather_rows, scatter_rows, signature
from .plan import Plan, assign_owners

_KEPT_STRUCTURES = 8  # step structures kept (least recently used dropped)


class DistributedEngine:
    """The engine `muonclip.distributed` registers (see module docstring)."""

    def __init__(self) -> None:
        self._structures: OrderedDict[tuple, _Structure] = OrderedDict()  # a few, for several optimizers

    def context(self, params: Sequence[Tensor], name_of: Callable[[int], str], process_group: Any) -> GroupContext:
        """`muonclip.distributed.context.resolve_group`: the group, and a clear error for a
        layout Muon cannot handle, before any collective."""
        return resolve_group(params, name_of, process_group)

    def local(self, t: Tensor) -> Tensor:
        """`muonclip.distributed.context.local`."""
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
            ctx: the group (`context`).
            backend: the optimizer's backend (`muonclip.optim.backend`).
            new_buffer: makes a parameter's momentum buffer.
            comm_dtype: wire dtype of the exchanges (None: the momentum dtype).
        """
        stats = StepStats(world_size=ctx.world_size)
        if not items:
            return stats
        if ctx.world_size > 1:
            sig = signature([(tuple(p.shape), p.dtype, *options_key(g)) for g, p, _ in items])
            agree(ctx, sig, [p.grad is not None for _, p, _ in items], [n() for _, _, n in items],
                  local(items[0][1]).device, stats.comm)
        live = [(g, p) for g, p, _ in items if p.grad is not None]
        if not live:
            return stats
        bufs = []
        for _, p in live:
            if "momentum_buffer" not in state[p]:
                state[p]["momentum_buffer"] = new_buffer(p)
            bufs.append(local(state[p]["momentum_buffer"]))
        pending = set(range(len(live)))

        def momentum(k: int) -> Tensor:
            """Item k's momentum buffer, updated (once per step) on first use."""
            if k in pending:
                pending.discard(k)
                momentum_(bufs[k], local(live[k][1].grad), live[k][0]["momentum"])
            return bufs[k]

        def v_of(k: int, out: Tensor | None = None) -> Tensor:
            g = live[k][0]
            return muon_input(local(live[k][1].grad), momentum(k), g["momentum"], g["nesterov"], out=out)

        st = self._cached_structure(live, ctx)
        plan = st.plan
        stats.total_ns_flops = sum(plan.flops)
        shapes = [p.shape for _, p in live]
        dtype, device = bufs[0].dtype, bufs[0].device
        wire = comm_dtype or dtype

        # 4. whole V of the row-sharded items, on their owners
        whole: dict[int, Tensor] = {}
        if st.rows_idx:
            got = gather_rows(ctx, [v_of(k) for k in st.rows_idx], [shapes[k] for k in st.rows_idx],
                              [plan.owners[k] for k in st.rows_idx], wire, stats.comm)
            whole = {st.rows_idx[j]: t for j, t in got.items()}

        def write(k: int, b: int, dst: Tensor) -> None:
            g = live[k][0]
            if k in whole:  # gathered from the row shards
                dst.copy_(whole[k] if st.n_blocks[k] == 1 else block_views(whole[k], **matrix_options(g))[b])
            elif st.n_blocks[k] == 1:
                v_of(k, out=dst)
            else:  # only this block's V, straight into the bucket
                G, M = (block_views(t, **matrix_options(g))[b] for t in (local(live[k][1].grad), momentum(k)))
                muon_input(G, M, g["momentum"], g["nesterov"], out=dst)

        def apply(k: int, O: Tensor) -> None:
            g, p = live[k]
            axis, ranges = st.scales[k]
            apply_blocks_(local(p), O, lr=g["lr"], weight_decay=g["weight_decay"], axis=axis, ranges=ranges,
                          offset=st.offsets[k])

        # 5. orthogonalise the owned items; with one rank each is applied at once (7.)
        results: dict[int, Tensor] = {}
        single = ctx.world_size == 1
        stats.matrices = orthogonalize_buckets(st.buckets, st.n_blocks, [g for g, _ in live], shapes, write,
                                               apply if single else results.__setitem__, backend,
                                               reuse_result=single)
        stats.ns_flops = plan.flops[ctx.rank]
        for k in sorted(pending):  # momentum of the items this rank neither owns nor sends
            momentum(k)
        if single:
            return stats

        # 6. results back to every rank that holds rows, then 7.
        out: list[Tensor | None] = [None] * len(live)
        for idx, exchange in ((st.rep_idx, all_gather_owned), (st.rows_idx, scatter_rows)):
            if idx:  # replicated weights: all-gather of the owners' results; row-sharded: all-to-all
                got = exchange(ctx, {j: results[k] for j, k in enumerate(idx) if k in results},
                               [shapes[k] for k in idx], [plan.owners[k] for k in idx], wire, dtype, device,
                               stats.comm)
                for j, k in enumerate(idx):
                    out[k] = got[j]
        for k, O in enumerate(out):
            apply(k, O)
        return stats

    def _cached_structure(self, live: list[tuple[dict[str, Any], Tensor]], ctx: GroupContext) -> _Structure:
        """The step's `_Structure`, rebuilt only when the items' global shapes, layouts, devices,
        structural options, the rank or the world size changed."""
        key = (ctx.world_size, ctx.rank,
               tuple((options_key(g), tuple(p.shape), item_layout(p, ctx), local(p).device) for g, p in live))
        if key in self._structures:
            self._structures.move_to_end(key)
            return self._structures[key]
        layouts = [item_layout(p, ctx) for _, p in live]
        plan = assign_owners([item_flops(g, p.shape) for g, p in live], ctx.world_size)
        items = [(g, p.shape, local(p).device) for g, p in live]
        buckets, n_blocks = make_buckets(items, plan.owned(ctx.rank))
        st = _Structure(
            plan, [k for k, kind in enumerate(layouts) if kind == ROWS],
            [k for k, kind in enumerate(layouts) if kind != ROWS],
            [shard_rows(p.shape[0], ctx.world_size, ctx.rank)[0] if kind == ROWS else 0
             for (_, p), kind in zip(live, layouts)],
            [item_scales(g, p.shape) for g, p in live], buckets, n_blocks,
        )
        self._structures[key] = st
        if len(self._structures) > _KEPT_STRUCTURES:
            self._structures.popitem(last=False)
        return st


@dataclass
class _Structure:
    """What a step does that depends only on its items' shapes, options and layouts.

    Attributes:
        plan: owner rank of each item (`plan.assign_owners`).
        rows_idx, rep_idx: the items held as row shards / replicated (`context.item_layout`).
        offsets: global index of this rank's first row of each item (0 unless row-sharded).
        scales: per item ``(axis, ranges)`` (`muonclip.optim.buckets.item_scales`).
        buckets, n_blocks: the owned items' buckets (`muonclip.optim.buckets.make_buckets`).
    """

    plan: Plan
    rows_idx: list[int]
    rep_idx: list[int]
    offsets: list[int]
    scales: list[tuple[int, list[tuple[int, int, float]]]]
    buckets: list
    n_blocks: dict[int, int]


register_engine(DistributedEngine())

__all__ = ["DistributedEngine"]
