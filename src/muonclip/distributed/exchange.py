"""The collectives of a distributed Muon step, each batched into one call for all matrices.

Three exchanges (docs/design.md, "Distributed Muon"), every one called on every rank of the group, in the same
order, whatever that rank holds (a rank that owns nothing, or holds an empty shard, still
sends and receives zero-length pieces):

* `agree` — one small int64 MAX all-reduce that checks, before any data moves, that every
  rank has the same parameters (a signature of global shapes and options) and the same set
  of gradients. On a mismatch every rank raises the same error, so no rank is left waiting
  in a collective the others never enter.
* `gather_rows` / `scatter_rows` — FSDP2 (``Shard(0)`` parameters): one ``all_to_all`` sends
  each owner the row shards of its matrices, the owner orthogonalises whole matrices, and a
  second ``all_to_all`` sends each rank its rows of the result. Momentum never leaves its
  shard except as this transient V.
* `all_gather_owned` — DDP (replicated parameters): each rank contributes the results of
  the matrices it owns, padded to the longest share, in one all-gather into a single tensor.

``comm_dtype`` (default: the momentum dtype, float32) is the wire dtype. bfloat16 halves the
bytes; with ``orth_dtype=bfloat16`` and the built-in methods (which cast V to bf16 before
anything else and return bf16 values) it changes nothing in the result.

Tensors may live on any device the backend supports (gloo: CPU; NCCL: CUDA).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..optim.engine import CommStats
from .context import GroupContext, row_blocks


def signature(parts: Sequence[object]) -> int:
    """A 62-bit checksum of ``repr(parts)`` that is the same in every process (unlike ``hash``)."""
    text = repr(tuple(parts)).encode()
    return (zlib.crc32(text) << 30) ^ zlib.adler32(text)


def agree(ctx: GroupContext, sig: int, has_grad: Sequence[bool], names: Sequence[str], device: torch.device,
          stats: CommStats) -> None:
    """Check that every rank has the same Muon parameters and the same gradients present.

    One all-reduce (MAX) of ``[sig, -sig, g_0..g_n, -g_0..-g_n]`` gives both the max and the
    min over ranks of each entry. Raises ValueError on every rank if they differ.
    """
    flags = torch.tensor([int(b) for b in has_grad], dtype=torch.int64)
    packed = torch.cat([torch.tensor([sig, -sig], dtype=torch.int64), flags, -flags]).to(device)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=ctx.group)
    stats.add("all_reduce", 2 * packed.numel() * 8 * (ctx.world_size - 1) // ctx.world_size)
    packed = packed.cpu().tolist()
    if packed[0] != -packed[1]:
        raise ValueError(
            "the Muon parameters differ across ranks (number, order, global shapes or options): every rank "
            "must build the same model and optimizer, or the collectives would pair the wrong tensors"
        )
    n = len(has_grad)
    mixed = [names[i] for i in range(n) if packed[2 + i] != -packed[2 + n + i]]
    if mixed:
        raise ValueError(
            f"{', '.join(mixed[:5])} has a gradient on some ranks but not on others; every rank must see the "
            "same set of gradients (zero the unused ones, e.g. loss + 0 * p.sum(), or use DDP's "
            "find_unused_parameters)"
        )


def _rest(shape: Sequence[int]) -> int:
    n = 1
    for s in shape[1:]:
        n *= s
    return n


def gather_rows(
    ctx: GroupContext,
    shards: Sequence[Tensor],  # item i: (rows_i on this rank, *shape_i[1:]), momentum dtype
    shapes: Sequence[torch.Size],  # item i: global shape
    owners: Sequence[int],
    comm_dtype: torch.dtype,
    stats: CommStats,
) -> dict[int, Tensor]:
    """All-to-all the row shards of each item to its owner; return ``{i: whole (shape_i)}`` for owned items."""
    me, world = ctx.rank, ctx.world_size
    blocks = [row_blocks(s[0], ctx) for s in shapes]
    send_parts: list[list[Tensor]] = [[] for _ in range(world)]
    for i, shard in enumerate(shards):
        send_parts[owners[i]].append(shard.reshape(-1))
    in_splits = [sum(t.numel() for t in parts) for parts in send_parts]
    mine = [i for i in range(len(shards)) if owners[i] == me]
    out_splits = [sum(blocks[i][src][1] * _rest(shapes[i]) for i in mine) for src in range(world)]
    dtype = shards[0].dtype if shards else torch.float32
    device = shards[0].device if shards else torch.device("cpu")
    send = _cat([t for parts in send_parts for t in parts], comm_dtype, device)
    recv = torch.empty(sum(out_splits), dtype=comm_dtype, device=device)
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=ctx.group)
    stats.add("all_to_all", (send.numel() - in_splits[me]) * send.element_size())
    pieces: dict[int, list[Tensor]] = {i: [] for i in mine}
    for src, chunk in enumerate(recv.split(out_splits)):
        sizes = [blocks[i][src][1] * _rest(shapes[i]) for i in mine]
        for i, piece in zip(mine, chunk.split(sizes)):
            pieces[i].append(piece.view(blocks[i][src][1], *shapes[i][1:]))
    return {i: torch.cat(pieces[i]).to(dtype) for i in mine}


def scatter_rows(
    ctx: GroupContext,
    wholes: dict[int, Tensor],  # owned item i: (shape_i) result, momentum dtype
    shapes: Sequence[torch.Size],
    owners: Sequence[int],
    comm_dtype: torch.dtype,
    dtype: torch.dtype,
    device: torch.device,
    stats: CommStats,
) -> list[Tensor]:
    """All-to-all each owned result's rows back to the rank that holds them; return this rank's rows per item."""
    me, world = ctx.rank, ctx.world_size
    blocks = [row_blocks(s[0], ctx) for s in shapes]
    mine = [i for i in range(len(shapes)) if owners[i] == me]
    send_list: list[Tensor] = []
    in_splits = []
    for dst in range(world):
        parts = [wholes[i].narrow(0, *blocks[i][dst]).reshape(-1) for i in mine]
        send_list += parts
        in_splits.append(sum(t.numel() for t in parts))
    theirs = [[i for i in range(len(shapes)) if owners[i] == src] for src in range(world)]
    out_splits = [sum(blocks[i][me][1] * _rest(shapes[i]) for i in theirs[src]) for src in range(world)]
    send = _cat(send_list, comm_dtype, device)
    recv = torch.empty(sum(out_splits), dtype=comm_dtype, device=device)
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=ctx.group)
    stats.add("all_to_all", (send.numel() - in_splits[me]) * send.element_size())
    out: list[Tensor | None] = [None] * len(shapes)
    for src, chunk in enumerate(recv.split(out_splits)):
        sizes = [blocks[i][me][1] * _rest(shapes[i]) for i in theirs[src]]
        for i, piece in zip(theirs[src], chunk.split(sizes)):
            out[i] = piece.view(blocks[i][me][1], *shapes[i][1:]).to(dtype)
    return out  # type: ignore[return-value]


def all_gather_owned(
    ctx: GroupContext,
    wholes: dict[int, Tensor],  # owned item i: (shape_i) result, momentum dtype
    shapes: Sequence[torch.Size],
    owners: Sequence[int],
    comm_dtype: torch.dtype,
    dtype: torch.dtype,
    device: torch.device,
    stats: CommStats,
) -> list[Tensor]:
    """One all-gather of every rank's owned results (padded to the longest share); return all results."""
    world = ctx.world_size
    numel = [torch.Size(s).numel() for s in shapes]
    owned = [[i for i in range(len(shapes)) if owners[i] == r] for r in range(world)]
    length = max(sum(numel[i] for i in idx) for idx in owned)
    buf = torch.zeros(length, dtype=comm_dtype, device=device)
    mine = owned[ctx.rank]
    if mine:
        buf[: sum(numel[i] for i in mine)] = _cat([wholes[i].reshape(-1) for i in mine], comm_dtype, device)
    out = torch.empty(world * length, dtype=comm_dtype, device=device)
    _all_gather_single(out, buf, group=ctx.group)
    stats.add("all_gather", (world - 1) * length * buf.element_size())
    result: list[Tensor | None] = [None] * len(shapes)
    for r, chunk in enumerate(out.split(length)):
        sizes = [numel[i] for i in owned[r]]
        for i, piece in zip(owned[r], chunk[: sum(sizes)].split(sizes)):
            result[i] = piece.view(shapes[i]).to(dtype)
    return result  # type: ignore[return-value]


def _all_gather_single(out: Tensor, inp: Tensor, group: Any) -> None:
    """``dist.all_gather_single`` where torch has it, else its older name ``all_gather_into_tensor``."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _cat(parts: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    if not parts:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([p.to(dtype) for p in parts])


__all__ = ["CommStats", "agree", "all_gather_owned", "gather_rows", "scatter_rows", "signature"]
