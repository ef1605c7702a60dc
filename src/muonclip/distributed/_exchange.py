"""The collectives of a distributed Muon step, each batched into one call for all matrices.

Three kinds of collective (docs/design.md, "Distributed Muon"), every one called on every rank of the group, in the same
order, whatever that rank holds (a rank that owns nothing, or holds an empty shard, still
sends and receives zero-length pieces):

* `agree_parameters` — one small int64 MAX all-reduce that checks, before any data moves, that every
  rank has the same parameters (a signature of global shapes, placements and options) and the
  same set of gradients. On a mismatch every rank raises the same error, so no rank is left
  waiting in a collective the others never enter.
* `agree_replicas` and `agree_copies` — when a step's structure is new: plain tensors hold the
  same values on every rank, and DTensor pieces that several ranks hold the same values on each.
* `exchange` — one ``all_to_all_single`` that moves a list of pieces (`Transfer`: source rank,
  destination rank, shape), all matrices at once. A step uses it twice: each owner receives
  the pieces of its matrices' V from ranks that hold them (for replicated pieces, from one
  holder only), and each rank that holds a piece of a matrix receives that piece of the
  result from the owner. Momentum never leaves its shard except as this transient V.

``comm_dtype`` (default: the momentum dtype, float32) is the wire dtype. bfloat16 halves the
bytes; with ``orth_dtype=bfloat16`` and the built-in methods (which cast V to bf16 before
anything else and return bf16 values) it changes nothing in the result.

Tensors may live on any device the backend supports (gloo: CPU; NCCL: CUDA).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..common._dtensor import Piece, is_empty, local
from ..optim.multiprocess import CommStats
from ._context import GroupContext


def all_reduce_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends in an all-reduce of ``nbytes`` over ``world`` ranks, by the ring
    algorithm's count (a reduce-scatter and an all-gather: ``2 (world - 1) / world`` of it, rounded
    down): what `CommStats` counts for every all-reduce of a step."""
    return 2 * nbytes * (world - 1) // world


def signature(parts: Sequence[object]) -> int:
    """A 62-bit checksum of ``repr(parts)`` that is the same in every process (unlike ``hash``)."""
    text = repr(tuple(parts)).encode()
    return (zlib.crc32(text) << 30) ^ zlib.adler32(text)


def agree_parameters(ctx: GroupContext, sig: int, has_grad: Sequence[bool], names: Sequence[Callable[[], str]],
          device: torch.device, stats: CommStats) -> None:
    """Check that every rank has the same Muon parameters and the same gradients present.

    One all-reduce (MAX) of ``[sig, -sig, g_0..g_n, -g_0..-g_n]`` gives both the max and the
    min over ranks of each entry. Raises ValueError on every rank if they differ, naming the
    parameters (``names[i]()``, formatted only then).
    """
    flags = torch.tensor([int(b) for b in has_grad], dtype=torch.int64)
    packed = torch.cat([torch.tensor([sig, -sig], dtype=torch.int64), flags, -flags]).to(device)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=ctx.group)
    stats.add("all_reduce", all_reduce_bytes(packed.numel() * 8, ctx.world_size))
    packed = packed.cpu().tolist()
    if packed[0] != -packed[1]:
        raise ValueError(
            "the Muon parameters differ across ranks (number, order, global shapes or options): every rank "
            "must build the same model and optimizer, or the collectives would pair the wrong tensors. Under "
            "pipeline parallelism each stage holds other parameters: give each stage's optimizer its own ranks, "
            "process_group=<the stage's data-parallel group> ('local' for a one-rank stage)"
        )
    n = len(has_grad)
    mixed = [names[i]() for i in range(n) if packed[2 + i] != -packed[2 + n + i]]
    if mixed:
        raise ValueError(
            f"{', '.join(mixed[:5])} has a gradient on some ranks but not on others; every rank must see the "
            "same set of gradients (zero the unused ones, e.g. loss + 0 * p.sum(), or use DDP's "
            "find_unused_parameters)"
        )


FINGERPRINT_BYTES = 16
"""Bytes of one `fingerprint` (two int64)."""


def fingerprint(t: Tensor) -> Tensor:
    """An exact int64 checksum of ``t``'s bits (sum of its elements' bit patterns, and of their
    products with their positions): equal tensors give equal values on any hardware, with no
    floating-point rounding."""
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    b = t.detach().contiguous().reshape(-1).view(bits).to(torch.int64)
    pos = torch.arange(1, b.numel() + 1, dtype=torch.int64, device=b.device)
    return torch.stack([b.sum(), (b * pos).sum()])


def agree_replicas(ctx: GroupContext, tensors: Sequence[Tensor], names: Sequence[str], device: torch.device,
                   stats: CommStats) -> None:
    """Check that plain (non-DTensor) parameters, which the step treats as replicated, hold the same
    values on every rank; raise ValueError on every rank otherwise.

    One MAX all-reduce of ``[f, -f]`` per tensor (`fingerprint`). Run when a step's structure is
    new (the first step, or after a change): a plain tensor that is really a shard (tensor
    parallelism with local tensors instead of DTensors) would otherwise get another rank's update.
    """
    if not tensors:
        return
    f = torch.cat([fingerprint(t).to(device) for t in tensors])
    packed = torch.cat([f, -f])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=ctx.group)
    stats.add("all_reduce", all_reduce_bytes(packed.numel() * 8, ctx.world_size))
    hi, lo = packed[: f.numel()].view(-1, 2), -packed[f.numel():].view(-1, 2)
    bad = [names[i] for i in (hi != lo).any(dim=1).nonzero().flatten().tolist()]
    if bad:
        raise ValueError(
            f"{', '.join(bad[:5])} is a plain tensor with different values on different ranks; Muon treats plain "
            "tensors as replicated (DDP). A weight sharded by tensor parallelism must be a DTensor "
            "(parallelize_module, distribute_tensor, DTensor.from_local), so that Muon can assemble whole "
            "matrices; replicated weights must start equal on every rank (DDP broadcasts them). Under pipeline "
            "parallelism other ranks hold other stages: pass process_group=<the stage's data-parallel group> "
            "('local' for a one-rank stage)"
        )


def agree_copies(ctx: GroupContext, tensors: Sequence[Tensor], pieces: Sequence[Sequence[Piece]],
                 names: Sequence[Callable[[], str]], device: torch.device, stats: CommStats) -> None:
    """Check that DTensor parameters whose pieces several ranks hold (the copies of a submesh, a
    ``Replicate`` dimension; ``pieces[k][r]`` is group rank r's piece of ``tensors[k]``) hold the
    same values wherever a piece repeats; raise ValueError on every rank otherwise.

    One ``all_gather`` of every rank's `fingerprint` of each tensor's local piece, run when a
    step's structure is new. The step gathers V from one holder of a piece and sends the result
    to every holder: under pipeline parallelism a mesh that spans the stages lays out the other
    stages' ranks as copies of this stage's parameters, and their values differ. Nothing is sent
    when ``tensors`` is empty.
    """
    if not tensors:
        return
    mine = torch.stack([fingerprint(local(t)) for t in tensors]).to(device)
    every = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(every, mine, group=ctx.group)
    stats.add("all_gather", FINGERPRINT_BYTES * len(tensors) * (ctx.world_size - 1))
    for k in range(len(tensors)):
        first: dict[Piece, int] = {}
        for r, pc in enumerate(pieces[k]):
            if is_empty(pc):
                continue
            seen = first.setdefault(pc, r)
            if seen != r and not torch.equal(every[r][k], every[seen][k]):
                raise ValueError(
                    f"{names[k]()} holds different values on ranks {ctx.ranks[seen]} and {ctx.ranks[r]}, which its "
                    f"device mesh {getattr(tensors[k], 'device_mesh', None)} lays out as holding the same piece "
                    "(copies of a submesh, or a Replicate dimension), so Muon would take one for the other. Under "
                    "pipeline parallelism the mesh spans the stages, whose parameters differ: give each stage's "
                    "optimizer its own ranks, process_group=<the stage's data/tensor-parallel group>. Otherwise "
                    "replicated pieces must start equal (distribute_tensor, fully_shard and DCP make them so)"
                )


@dataclass(frozen=True)
class Transfer:
    """One piece that moves: from group rank ``src`` to ``dst``, of ``shape``."""

    src: int
    dst: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements of the piece."""
        return math.prod(self.shape)


def exchange(ctx: GroupContext, transfers: Sequence[Transfer], payload: Callable[[int], Tensor],
             comm_dtype: torch.dtype, device: torch.device, stats: CommStats) -> dict[int, Tensor]:
    """Move every piece of ``transfers`` in ONE ``all_to_all_single``; return ``{j: piece}`` of the
    transfers whose ``dst`` is this rank (shaped ``transfers[j].shape``, in ``comm_dtype``).

    ``payload(j)`` gives the tensor of transfer j for the transfers this rank sends. Every rank must
    pass the same ``transfers`` (computed from the plan, identical everywhere); a rank with nothing
    to send or receive still enters the collective, with zero-length splits.
    """
    me, world = ctx.rank, ctx.world_size
    outgoing = [[j for j, r in enumerate(transfers) if r.src == me and r.dst == dst] for dst in range(world)]
    incoming = [[j for j, r in enumerate(transfers) if r.dst == me and r.src == src] for src in range(world)]
    in_splits = [sum(transfers[j].numel for j in js) for js in outgoing]
    out_splits = [sum(transfers[j].numel for j in js) for js in incoming]
    send = _cat([payload(j).reshape(-1) for js in outgoing for j in js], comm_dtype, device)
    recv = torch.empty(sum(out_splits), dtype=comm_dtype, device=device)
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=ctx.group)
    stats.add("all_to_all", send.numel() * send.element_size())
    out: dict[int, Tensor] = {}
    for js, chunk in zip(incoming, recv.split(out_splits)):
        for j, piece in zip(js, chunk.split([transfers[j].numel for j in js])):
            out[j] = piece.view(transfers[j].shape)
    return out


def _cat(parts: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    if not parts:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([p.to(dtype) for p in parts])
