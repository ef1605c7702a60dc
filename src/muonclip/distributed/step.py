"""The Muon update of one step, for one process, DDP and FSDP2 alike (design.md 1.4).

Phases (every rank runs all of them; collectives only when the group has > 1 rank):

1. **Agree** (multi-rank only): one small all-reduce checks that every rank has the same
   Muon parameters and the same gradients present (`exchange.agree`).
2. **Momentum** on what each rank holds: ``M = mu M + G``, ``V = G + mu M`` (or ``M``),
   each item's just before its V is formed. Under FSDP2 ``M``, ``G`` and ``V`` are row
   shards: momentum stays sharded.
3. **Plan**: every parameter gets one owner rank, balanced by Newton–Schulz flops
   (`plan.assign_owners`); the same on every rank, no communication.
4. **Gather**: owners get whole V: row-sharded ones by one all-to-all (`gather_rows`);
   replicated ones are already whole.
5. **Orthogonalise** on the owner only, on whole matrices: the owner's blocks of the same
   shape and settings are batched into one ``orthogonalize`` call per bucket.
6. **Exchange**: results go back — all-to-all of each rank's rows (FSDP2), all-gather of the
   owned results (DDP).
7. **Apply**: per matrix block ``U = scale(A, B) * O``; ``W = W (1 - lr wd) - lr U`` on each
   rank's own rows.

With a ``gate`` (``on_nonfinite="mask"``), momentum, weight decay and update take their
coefficients from it as 0-D device tensors (``mu`` -> 1, ``1 - lr wd`` -> 1, ``-lr scale`` ->
0 where the step is masked), so a masked step leaves weights and momentum bit-identical with no
host sync and no copy, and an unmasked one computes exactly the ungated arithmetic.

With one process every parameter is owned by rank 0, phases 1, 4 and 6 are no-ops, phase 7
runs for each item as soon as its bucket is orthogonalised (its result still in cache), and
the buckets are exactly those of a plain loop, so results are bit-identical to the
non-distributed algorithm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..optim.matrices import block_views
from ..optim.nonfinite import StepGate
from ..optim.scale import update_scale
from ..ortho import METHODS, orthogonalize
from ..ortho.scratch import kept
from .context import ROWS, GroupContext, item_layout, local, resolve_group, shard_rows
from .exchange import CommStats, agree, all_gather_owned, gather_rows, scatter_rows, signature
from .plan import Plan, assign_owners, matrix_rows, ns_flops


@dataclass
class StepStats:
    """What this rank did in the last Muon step.

    Attributes:
        world_size: ranks in the group (1 without communication).
        matrices: matrices this rank orthogonalised (stacked experts count E each).
        ns_flops: Newton–Schulz flops of those matrices (`plan.ns_flops`).
        total_ns_flops: the same summed over every rank's share.
        comm: bytes sent and collective calls (`exchange.CommStats`).
    """

    world_size: int = 1
    matrices: int = 0
    ns_flops: int = 0
    total_ns_flops: int = 0
    comm: CommStats = field(default_factory=CommStats)


def _steps(group: dict[str, Any]) -> int:
    s = group["steps"]
    return METHODS[group["method"]].default_steps if s is None else s


def _opts(group: dict[str, Any]) -> dict[str, Any]:
    return dict(flatten=group["flatten"], split_sizes=group["split_sizes"], transposed=group.get("transposed", False),
                split_groups=group.get("split_groups", 1))


def _slot(dst: Tensor, view: Tensor) -> Tensor:
    """A bucket slot ``(E, G * s, B)`` seen as ``(E, G, s, B)``, the shape of `block_views`' block ``view``."""
    return dst.view(view.shape)


def _label(name: str | Callable[[], str]) -> str:
    return name() if callable(name) else name


def muon_step(
    params: Sequence[tuple[dict[str, Any], Tensor, str | Callable[[], str]]],
    state: dict[Tensor, dict[str, Any]],
    new_buffer: Callable[[Tensor], Tensor],
    process_group: Any = None,
    comm_dtype: torch.dtype | None = None,
    orthogonalize: Callable[..., Tensor] = orthogonalize,
    workspace: dict[Any, Any] | None = None,
    gate: StepGate | None = None,
) -> StepStats:
    """Apply one Muon update to every parameter of ``params`` that has a gradient.

    Args:
        params: every parameter of the optimizer's Muon groups, with or without a gradient,
            as ``(group, param, name)`` in optimizer order (the order fixes the plan); ``name``
            (for errors) is a string or a function returning one, called only when needed.
        state: the optimizer's per-parameter state; ``"momentum_buffer"`` is created with
            ``new_buffer(param)`` (a DTensor for a DTensor parameter, so checkpoints reshard).
        process_group: see `muonclip.Muon` (None: automatic; ``"local"``: no communication).
        comm_dtype: wire dtype of the exchanges (None: the momentum dtype).
        orthogonalize: the function called once per bucket (default
            `muonclip.orthogonalize`; `Muon` passes its module's name so it can be wrapped).
        workspace: a dict the caller keeps between steps (default None: none). The step's
            plan, buckets and update scales are kept there and reused while the items'
            shapes, options and layouts stay the same (`_structure`; half of the fixed cost
            per step). With one process on CPU each bucket's input and result are also cut
            from two buffers kept there, reused by every bucket and step, and with any number
            of processes Newton–Schulz keeps its temporaries there (``orthogonalize``'s
            ``scratch``), and Nesterov's V is formed in the momentum's dtype in a kept
            buffer, then cast into the bucket (on CPU 0.65x the time of torch's mixed-dtype
            ``add`` into a bf16 slot, 384 x 1536; the same bits): fresh multi-MB buffers
            cost thousands of page faults a step on CPU (glibc returns them to the OS); GPUs
            have a caching allocator and never use them.
        gate: `muonclip.optim.nonfinite.StepGate` of a masked step (default None: none), the
            gradients already zeroed where its flag is set (`MaskedStep` does both); where it
            is set the step leaves every weight and momentum buffer exactly as it was.
    """
    stats = StepStats()
    if not params:
        return stats
    ctx = resolve_group([p for _, p, _ in params], lambda i: _label(params[i][2]), process_group)
    stats.world_size = ctx.world_size
    if ctx.world_size > 1:
        sig = signature([(tuple(p.shape), p.dtype, g["method"], *_opts(g).values()) for g, p, _ in params])
        agree(ctx, sig, [p.grad is not None for _, p, _ in params], [_label(n) for _, _, n in params],
              local(params[0][1]).device, stats.comm)
    live = [(g, p) for g, p, _ in params if p.grad is not None]
    if not live:
        return stats

    # 2. momentum, on the rows this rank holds: M = G + mu M in one pass, done for each item
    #    just before its V is formed (so G and M are still in cache when V reads them; the
    #    order of these independent updates does not change a bit), and for every item left
    #    over at the end of the step. The Nesterov V = G + mu M is formed only where it is used
    #    (every row shard, and the replicated matrices this rank owns), by `v_into` straight
    #    into the orthogonaliser's input.
    bufs: list[Tensor] = []
    for _, p in live:
        st = state[p]
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = new_buffer(p)
        bufs.append(local(st["momentum_buffer"]))
    pending = set(range(len(live)))

    def momentum(k: int) -> Tensor:
        """Item k's momentum buffer, updated (once per step) on first use."""
        if k in pending:
            pending.discard(k)
            mu, grad = live[k][0]["momentum"], local(live[k][1].grad)
            if gate is None:
                torch.add(grad, bufs[k], alpha=mu, out=bufs[k])
            else:  # mu -> 1 on a masked step (grad zeroed): M unchanged
                torch.addcmul(grad, bufs[k], gate.where(mu, 1.0, bufs[k]), out=bufs[k])
        return bufs[k]

    def v_into(k: int, out: Tensor | None = None, block: int | None = None) -> Tensor:
        """V of item k (or of its matrix block ``block``, as `block_views` cuts it, into the
        bucket slot ``out``), written into ``out`` (any dtype, that shape: the item's local shape
        for the whole item) if given."""
        g, p = live[k]
        buf, grad = momentum(k), local(p.grad)
        if block is not None:
            buf, grad = (block_views(t, **_opts(g))[block] for t in (buf, grad))
            out = _slot(out, buf)
        if not g["nesterov"]:
            return buf if out is None else out.copy_(buf)
        wide = None if out is None or out.dtype == buf.dtype else kept(workspace, "v", out.shape, buf.dtype, buf.device)
        if wide is not None:  # in buf's dtype, then one cast: faster on CPU than the mixed-dtype add
            return out.copy_(torch.add(grad, buf, alpha=g["momentum"], out=wide))
        return torch.add(grad, buf, alpha=g["momentum"], out=out)

    # 3. plan (and buckets, layouts, update scales): cached while the items' shapes, options
    #    and layouts stay the same, which is every step of a normal run
    st = _structure(live, ctx, workspace)
    plan, rows_idx, rep_idx = st.plan, st.rows_idx, st.rep_idx
    stats.total_ns_flops = sum(plan.flops)
    shapes = [p.shape for _, p in live]
    dtype, device = bufs[0].dtype, bufs[0].device
    wire = comm_dtype or dtype

    def apply(k: int, res: Tensor) -> None:
        """7. ``W = W (1 - lr wd) - lr scale * O`` on this rank's rows of item k."""
        g, p = live[k]
        w, lr, wd = local(p), g["lr"], g["weight_decay"]
        if wd != 0.0:
            w.mul_(1.0 - lr * wd if gate is None else gate.where(1.0 - lr * wd, 1.0, w))
        _add_scaled_(w, res, *st.scaled[k], st.offsets[k], -lr, gate)

    # 4. whole V on the owner (None: this rank holds it whole, formed in phase 5)
    whole: dict[int, Tensor | None] = {k: None for k in rep_idx if plan.owners[k] == ctx.rank}
    if rows_idx:
        got = gather_rows(ctx, [v_into(k) for k in rows_idx], [shapes[k] for k in rows_idx],
                          [plan.owners[k] for k in rows_idx], wire, stats.comm)
        whole.update({rows_idx[j]: t for j, t in got.items()})

    # 5. orthogonalise owned matrices, one call per bucket. With one process each item is
    #    updated (phase 7) as soon as its result is complete, while the result is in cache.
    O: dict[int, Tensor] = {}
    _orthogonalize_owned(live, whole, st, v_into, stats, orthogonalize,
                         done=apply if ctx.world_size == 1 else O.__setitem__,
                         workspace=workspace if ctx.world_size == 1 else None, scratch=workspace)
    stats.ns_flops = plan.flops[ctx.rank]
    for k in sorted(pending):  # momentum of the items this rank neither owns nor sends
        momentum(k)

    # 6. results back to every rank that holds rows
    if ctx.world_size > 1:
        result: list[Tensor | None] = [None] * len(live)
        if rep_idx:
            got = all_gather_owned(ctx, {rep_idx.index(k): O[k] for k in rep_idx if k in O},
                                   [shapes[k] for k in rep_idx], [plan.owners[k] for k in rep_idx],
                                   wire, dtype, device, stats.comm)
            for j, k in enumerate(rep_idx):
                result[k] = got[j]
        if rows_idx:
            got = scatter_rows(ctx, {rows_idx.index(k): O[k] for k in rows_idx if k in O},
                               [shapes[k] for k in rows_idx], [plan.owners[k] for k in rows_idx],
                               wire, dtype, device, stats.comm)
            for j, k in enumerate(rows_idx):
                result[k] = got[j]
        for k, res in enumerate(result):
            apply(k, res)
    return stats


@dataclass
class _Bucket:
    """Same-shape matrix blocks with the same settings: one ``orthogonalize`` call."""

    A: int
    B: int
    device: torch.device
    method: str
    steps: int | None
    dtype: torch.dtype | None
    eps: float
    coefficients: tuple[float, float, float] | None
    entries: list[tuple[int, int]] = field(default_factory=list)  # (item, block)
    sizes: list[int] = field(default_factory=list)  # matrices of each entry (E for stacked experts)


@dataclass
class _Structure:
    """What a step does that depends only on its items' shapes, options and layouts.

    Attributes:
        plan: owner rank of each item (`plan.assign_owners`).
        rows_idx, rep_idx: the items held as row shards / replicated (`context.item_layout`).
        offsets: global index of this rank's first row of each item (0 unless row-sharded).
        scaled: per item ``(axis, [(a, b, update scale)])``: its matrix blocks as row ranges
            along ``axis`` (`plan.matrix_rows`) and each block's update scale.
        n_blocks: blocks of each item this rank orthogonalises.
        buckets: those blocks grouped by shape and settings.
    """

    plan: Plan
    rows_idx: list[int]
    rep_idx: list[int]
    offsets: list[int]
    scaled: list[tuple[int, list[tuple[int, int, float]]]]
    n_blocks: dict[int, int]
    buckets: list[_Bucket]


_KEY_OPTIONS = ("method", "steps", "orth_dtype", "eps", "ns_coefficients", "flatten", "split_sizes", "transposed",
                "split_groups", "update_scale")


def _frozen(v: Any) -> Any:
    return tuple(_frozen(x) for x in v) if isinstance(v, (list, tuple)) else v


def _structure(live: list[tuple[dict[str, Any], Tensor]], ctx: GroupContext,
               cache: dict[Any, Any] | None = None) -> _Structure:
    """The step's `_Structure`, from ``cache["structure"]`` when its key still matches (the
    items' global shapes, layouts, devices and structural options, the rank and world size;
    not lr, weight decay, momentum or Nesterov, which are read every step)."""
    options: dict[int, tuple] = {}  # per group, once
    for g, _ in live:
        if id(g) not in options:
            options[id(g)] = tuple(_frozen(g.get(o)) for o in _KEY_OPTIONS)
    key = (ctx.world_size, ctx.rank,
           tuple((options[id(g)], tuple(p.shape), item_layout(p, ctx), p.device) for g, p in live))
    if cache is not None:
        hit = cache.get("structure")
        if hit is not None and hit[0] == key:
            return hit[1]
    costs, scaled, offsets = [], [], []
    layouts = [item_layout(p, ctx) for _, p in live]
    for (g, p), kind in zip(live, layouts):
        axis, blocks, cols, batch = matrix_rows(p.shape, **_opts(g))
        sizes = [sum(b - a for a, b in segs) for segs in blocks]
        costs.append(ns_flops([(batch, n, cols) for n in sizes], max(_steps(g), 1)))
        scales = [update_scale(g["update_scale"], n, cols) for n in sizes]
        scaled.append((axis, _row_scales(blocks, scales)))
        offsets.append(shard_rows(p.shape[0], ctx.world_size, ctx.rank)[0] if kind == ROWS else 0)
    plan = assign_owners(costs, ctx.world_size)
    buckets: dict[tuple, _Bucket] = {}
    n_blocks: dict[int, int] = {}
    for k, ((g, p), owner) in enumerate(zip(live, plan.owners)):
        if owner != ctx.rank:
            continue
        _, blocks, cols, batch = matrix_rows(p.shape, **_opts(g))  # the shapes of block_views, no tensor made
        n_blocks[k] = len(blocks)
        device = local(p).device
        for b, segs in enumerate(blocks):
            rows = sum(r1 - r0 for r0, r1 in segs)
            fields = (rows, cols, device, g["method"], g["steps"], g["orth_dtype"], g["eps"], g["ns_coefficients"])
            bucket = buckets.setdefault(_frozen(fields), _Bucket(*fields))
            bucket.entries.append((k, b))
            bucket.sizes.append(batch)
    st = _Structure(plan, [k for k, kind in enumerate(layouts) if kind == ROWS],
                    [k for k, kind in enumerate(layouts) if kind != ROWS], offsets, scaled, n_blocks,
                    list(buckets.values()))
    if cache is not None:
        cache["structure"] = (key, st)
    return st


def _orthogonalize_owned(live: list[tuple[dict[str, Any], Tensor]], whole: dict[int, Tensor | None],
                         st: _Structure, v_into: Callable[..., Tensor], stats: StepStats,
                         orthogonalize: Callable[..., Tensor], done: Callable[[int, Tensor], None],
                         workspace: dict[Any, Any] | None = None, scratch: dict[Any, Any] | None = None) -> None:
    """Orthogonalise the owned items (``whole``'s keys, ``st.n_blocks``); ``done(k, orth(V_k))``
    (V_k's shape, compute dtype) as soon as item k's result is complete.

    Blocks of equal shape and settings are batched into one ``orthogonalize`` call per bucket
    (``st.buckets``). Each bucket's input is allocated once in the compute dtype and filled in
    place: by ``v_into(k, out[, block])`` for an item held whole here (``whole[k] is None``; a
    split item's V block by block), else from the gathered ``whole[k]``, so V is never
    materialised in float32 and then concatenated. A result that is one block is a view into
    its bucket's output (no copy); only items cut into several blocks (``split_sizes``) are
    assembled, after their last block's bucket.

    ``workspace`` (only where ``done`` has used every result before the next bucket starts,
    i.e. one process): on CPU each bucket's input and result live in two reused buffers
    (`muonclip.ortho.scratch.kept`). ``scratch``: passed to ``orthogonalize`` for its
    temporaries (any number of processes: they die within the call).
    """
    n_blocks = st.n_blocks
    pieces: dict[int, list[Tensor | None]] = {k: [None] * n for k, n in n_blocks.items()}
    missing = dict(n_blocks)
    for bk in st.buckets:
        cdtype = bk.dtype or METHODS[bk.method].default_dtype
        shape = (sum(bk.sizes), bk.A, bk.B)
        Vb = kept(workspace, "input", shape, cdtype, bk.device)
        if Vb is None:
            Vb = torch.empty(shape, dtype=cdtype, device=bk.device)
        for (k, b), dst in zip(bk.entries, Vb.split(bk.sizes)):
            g = live[k][0]
            if whole[k] is not None:  # gathered from the row shards
                src = block_views(whole[k], **_opts(g))[b]
                _slot(dst, src).copy_(src)
            elif n_blocks[k] == 1:
                v_into(k, _as_stored(dst, live[k][1].shape, g))
            else:  # only this block's V, straight into the bucket
                v_into(k, dst, block=b)
        stats.matrices += Vb.shape[0]
        buffer = kept(workspace, "result", shape, cdtype, bk.device)
        Ob = orthogonalize(Vb, bk.method, bk.steps, bk.dtype, eps=bk.eps, coefficients=bk.coefficients,
                           out_dtype=cdtype, buffer=buffer, scratch=scratch, overwrite=True)  # Vb: not read again
        for (k, b), r in zip(bk.entries, Ob.split(bk.sizes)):
            missing[k] -= 1
            # a block of an item still incomplete outlives this bucket: off the reused buffer
            pieces[k][b] = r.clone() if buffer is not None and missing[k] else r
            if missing[k] == 0:
                done(k, _assemble(pieces.pop(k), live[k][1].shape if whole[k] is None else whole[k].shape,
                                  live[k][0]))


def _assemble(parts: list[Tensor | None], shape: torch.Size, group: dict[str, Any]) -> Tensor:
    """An item's result from its blocks' results: the one block viewed in the stored layout,
    or several blocks copied into a new tensor of ``shape``."""
    if len(parts) == 1:
        return _as_stored(parts[0], shape, group)
    out = torch.empty(shape, dtype=parts[0].dtype, device=parts[0].device)
    for dst, r in zip(block_views(out, **_opts(group)), parts):
        dst.copy_(r.view(dst.shape))
    return out


def _as_stored(block: Tensor, shape: torch.Size, group: dict[str, Any]) -> Tensor:
    """A bucket slot ``(E, A, B)`` that holds a whole parameter, viewed in the parameter's stored
    layout (for ``transposed`` weights the strided transpose, so writes still land in the slot)."""
    if group.get("transposed", False):
        return block.mT if len(shape) == 3 else block[0].mT
    return block.view(shape)


def _row_scales(blocks: list[list[tuple[int, int]]], scales: list[float]) -> list[tuple[int, int, float]]:
    """Row ranges ``(a, b, scale)`` in row order, from each block's ranges and update scale:
    adjacent ranges with the same scale merged (every head of a per-head split, or q, k and v
    of equal shape, become one range: one add for the item)."""
    ranges = sorted((a, b, s) for segs, s in zip(blocks, scales) for a, b in segs)
    merged: list[tuple[int, int, float]] = []
    for a, b, s in ranges:
        if merged and merged[-1][1] == a and merged[-1][2] == s:
            merged[-1] = (merged[-1][0], b, s)
        else:
            merged.append((a, b, s))
    return merged


def _add_scaled_(w: Tensor, res: Tensor, axis: int, blocks: list[tuple[int, int, float]], offset: int,
                 alpha: float, gate: StepGate | None = None) -> None:
    """``w += alpha * scale_i * O`` per row range ``(a_i, b_i, scale_i)`` (rows ``[a_i, b_i)``
    along ``axis``, as `plan.matrix_rows` states them, each range's block scale: `_row_scales`),
    ``w``/``res`` holding the rows ``[offset, offset + len(res))`` of the parameter (all of them
    without sharding; only ``axis`` 0 is ever sharded).

    The orthogonalised result is added as it is (e.g. bf16 into a float32 weight, as
    torch.optim.Muon does): no scaled copy is made. With a ``gate`` the coefficient is a 0-D
    tensor, 0 on a masked step (``addcmul_`` rounds exactly as ``add_`` with ``alpha``).
    """

    def add_(dst: Tensor, src: Tensor, coefficient: float) -> None:
        if gate is None:
            dst.add_(src, alpha=coefficient)
        else:
            dst.addcmul_(src, gate.where(coefficient, 0.0, dst))

    if axis >= 1:  # stacked experts, transposed weights: every local expert / stored row has every block
        if len(blocks) == 1 and blocks[0][0] == 0 and blocks[0][1] == w.shape[axis]:
            add_(w, res, alpha * blocks[0][2])
            return
        for a, b, s in blocks:
            add_(w.narrow(axis, a, b - a), res.narrow(axis, a, b - a), alpha * s)
        return
    n = res.shape[0]
    if len(blocks) == 1 and offset == 0 and blocks[0][0] == 0 and blocks[0][1] == n == w.shape[0]:
        add_(w, res, alpha * blocks[0][2])  # the usual case: one block, all rows here (no views)
        return
    for a, b, s in blocks:
        lo, hi = max(a, offset), min(b, offset + n)
        if lo < hi:
            add_(w[lo - offset : hi - offset], res[lo - offset : hi - offset], alpha * s)


__all__ = ["StepStats", "muon_step", "Plan", "GroupContext"]
