"""Where DeepSpeed ZeRO keeps each weight: which element range of it every rank's partition holds.

DeepSpeed's ZeRO optimizers hand the client optimizer flat float32 partitions instead of the
model's parameters (docs/integrations.md, "DeepSpeed"):

* **ZeRO-1 and ZeRO-2** (``DeepSpeedZeroOptimizer``), and ZeRO-1 in bfloat16 (``BF16_Optimizer``):
  the parameters of a param group are flattened one after the other (with alignment padding)
  into one buffer, cut into equal contiguous partitions, one per data-parallel rank; the
  optimizer's group holds this rank's float32 master partition. A weight may straddle
  partitions: rank r holds elements ``[max(o, r s), min(o + n, (r + 1) s)) - o`` of a weight of n
  elements at offset o, partitions of s elements.
* **ZeRO-3** (``DeepSpeedZeroOptimizer_Stage3``): every parameter is flattened and cut alone into
  equal partitions of ``ceil(n / world)`` elements (``ds_tensor``, the last one padded); a
  sub-group's float32 master partition is the concatenation of its parameters' partitions.

`zero_parts` reads this from the DeepSpeed optimizer (no communication: every rank computes
every rank's ranges) into one `Part` per param group (ZeRO-3: per sub-group), each with its
`Member` weights: the float32 master elements this rank holds, every rank's piece of the weight
(`muonclip.common._dtensor.FlatRange`, or the whole weight), and where the low-precision copy
DeepSpeed trains keeps the same elements (written again after QK-Clip scaled the master).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..common._dtensor import FlatRange, Piece


@dataclass
class Member:
    """One weight of a partitioned param group.

    Attributes:
        param: the model's parameter (its data is DeepSpeed's low-precision copy, or, under ZeRO-3,
            an empty placeholder).
        name: its name, for messages.
        shape: its shape as the model defines it.
        lo, hi: the elements of the group's float32 master partition that hold this rank's piece.
        pieces: every rank's piece of the weight: a `FlatRange` of its flattened elements, the whole
            weight (a tuple of ranges), or an empty range.
        lp: this rank's elements of the low-precision copy DeepSpeed trains (1-D, ``hi - lo``
            elements), or None where DeepSpeed copies the master after the step itself.
        meta: a tensor of the weight's shape on the meta device, what the step's structure is
            planned on.
    """

    param: Tensor
    name: str
    shape: tuple[int, ...]
    lo: int
    hi: int
    pieces: list[Piece]
    lp: Callable[[], Tensor] | None
    meta: Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.meta = torch.empty(self.shape, device="meta")

    def piece(self, rank: int) -> Piece:
        """This rank's piece."""
        return self.pieces[rank]

    def view(self, flat: Tensor, rank: int) -> Tensor:
        """This rank's elements of ``flat`` (the master partition, its gradient or momentum): the
        weight's shape when the rank holds all of it, else 1-D."""
        part = flat[self.lo:self.hi]
        return part.view(self.shape) if not isinstance(self.pieces[rank], FlatRange) else part


@dataclass
class Part:
    """One param group's partition on this rank (ZeRO-3: one sub-group's).

    Attributes:
        index: which of the DeepSpeed optimizer's groups (sub-groups) it is.
        flat: this rank's float32 master partition (what the optimizer's param group holds).
        members: its weights, in the group's order.
        group: the data-parallel process group it is partitioned over; rank, world: this rank's
            index in it, and its size.
    """

    index: int
    flat: Tensor
    members: list[Member]
    group: Any
    rank: int
    world: int


def _ranges(offset: int, numel: int, size: int, world: int, shape: tuple[int, ...]) -> list[Piece]:
    """Every rank's piece of a weight of ``numel`` elements at ``offset`` of a buffer cut into
    partitions of ``size`` elements."""
    out: list[Piece] = []
    for r in range(world):
        lo, hi = max(offset, r * size), min(offset + numel, (r + 1) * size)
        if hi <= lo:
            out.append(FlatRange(0, 0))
        elif hi - lo == numel:
            out.append(tuple(range(n) for n in shape))
        else:
            out.append(FlatRange(lo - offset, hi - offset))
    return out


def _names(wrapper: Any) -> dict[int, str]:
    names = getattr(wrapper, "param_names", None) or {}
    return {id(p): n for p, n in names.items()} if isinstance(names, dict) else {}


def _flat_groups(wrapper: Any, groups: Sequence[Sequence[Tensor]], offsets: Sequence[Sequence[int]],
                 sizes: Sequence[int], fp32: Sequence[Tensor], lp_partitions: Sequence[Tensor] | None,
                 dp_groups: Sequence[Any]) -> list[Part]:
    """Parts of the flattened-group layout (ZeRO-1/2, BF16_Optimizer)."""
    names, parts = _names(wrapper), []
    for i, (params, offs, size) in enumerate(zip(groups, offsets, sizes)):
        group = dp_groups[i]
        rank, world = dist.get_rank(group=group), dist.get_world_size(group=group)
        members = []
        for p, o in zip(params, offs):
            shape, n = tuple(p.shape), p.numel()
            lo, hi = max(o, rank * size) - rank * size, min(o + n, (rank + 1) * size) - rank * size
            lo, hi = (lo, hi) if hi > lo else (0, 0)
            lp = None if lp_partitions is None else (lambda t=lp_partitions[i], a=lo, b=hi: t[a:b])
            members.append(Member(p, names.get(id(p), f"parameter of shape {shape}"), shape, lo, hi,
                                  _ranges(o, n, size, world, shape), lp))
        parts.append(Part(i, fp32[i], members, group, rank, world))
    return parts


def _stage3(wrapper: Any) -> list[Part]:
    """Parts of ZeRO-3: each parameter partitioned alone; a sub-group's master is their concatenation."""
    names, parts = _names(wrapper), []
    for s, params in enumerate(wrapper.fp16_groups):
        group = wrapper.sub_group_process_groups[s]
        rank, world = dist.get_rank(group=group), dist.get_world_size(group=group)
        members, at = [], 0
        for p in params:
            shape, n, size = tuple(p.ds_shape), p.ds_numel, p.partition_numel()
            pieces = _ranges(0, n, size, world, shape)
            held = max(0, min((rank + 1) * size, n) - rank * size)
            members.append(Member(p, names.get(id(p), f"parameter of shape {shape}"), shape, at, at + held, pieces,
                                  lambda p=p, k=held: p.ds_tensor.view(-1)[:k]))
            at += size
        parts.append(Part(s, wrapper.fp32_partitioned_groups_flat[s], members, group, rank, world))
    return parts


def zero_parts(wrapper: Any) -> tuple[str, list[Part]]:
    """``(kind, parts)`` of a DeepSpeed optimizer: ``"zero"`` (ZeRO-1/2: one call of ``step()``
    per group), ``"zero3"`` (one call per sub-group) or ``"bf16"`` (``BF16_Optimizer``, ZeRO-1 in
    bfloat16: one call for every group)."""
    kind = type(wrapper).__name__
    if kind == "DeepSpeedZeroOptimizer":
        world = [dist.get_world_size(group=g) for g in wrapper.real_dp_process_group]
        lp = [wrapper.parallel_partitioned_bit16_groups[i][dist.get_rank(group=g)]
              for i, g in enumerate(wrapper.real_dp_process_group)]
        sizes = [wrapper.bit16_groups_flat[i].numel() // world[i] for i in range(len(world))]
        return "zero", _flat_groups(wrapper, wrapper.round_robin_bit16_groups, wrapper.round_robin_bit16_offsets,
                                    sizes, wrapper.single_partition_of_fp32_groups, lp,
                                    wrapper.real_dp_process_group)
    if kind == "BF16_Optimizer":
        offsets = []
        for params in wrapper.bf16_groups:
            at, offs = 0, []
            for p in params:
                offs.append(at)
                at += p.numel()
            offsets.append(offs)
        world = [dist.get_world_size(group=g) for g in wrapper.real_dp_process_group]
        sizes = [wrapper.bf16_groups_flat[i].numel() // world[i] for i in range(len(world))]
        return "bf16", _flat_groups(wrapper, wrapper.bf16_groups, offsets, sizes, wrapper.fp32_groups_flat_partition,
                                    None, wrapper.real_dp_process_group)
    if kind == "DeepSpeedZeroOptimizer_Stage3":
        return "zero3", _stage3(wrapper)
    raise TypeError(f"not a DeepSpeed ZeRO optimizer muonclip knows: {kind}")


def pending_gradients(wrapper: Any, kind: str, index: int) -> list[Tensor]:
    """This rank's gradients of part ``index`` (`zero_parts`) that DeepSpeed holds during a step
    before it hands them to the optimizer (``"zero"``, ``"zero3"``: ``averaged_gradients``, the
    tensors DeepSpeed's own gradient norm reads; loss-scaled in fp16, not yet clipped), or none:
    a ``"bf16"`` step hands every part over in one call, and a part already handed over holds
    its gradient as the partition's ``.grad``."""
    if kind == "bf16":
        return []
    try:
        grads = wrapper.averaged_gradients[index]
    except (AttributeError, KeyError, IndexError, TypeError):
        return []
    if grads is None:
        return []
    flat = getattr(grads, "flat_partition", None)
    if flat is not None:
        return [flat]
    return [g for g in grads if g is not None]


__all__ = ["Member", "Part", "pending_gradients", "zero_parts"]
