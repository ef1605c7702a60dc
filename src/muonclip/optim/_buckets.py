"""The structure of a Muon step: units of work, buckets of same-shape matrix blocks, where results apply.

A Muon step cuts each weight into its matrix blocks (`muonclip.optim._matrices.MatrixSpec`: a
2-D weight is one, stacked experts ``(E, A, B)`` are E, a fused weight with ``split_sizes`` one
per part) and groups the blocks of equal shape and orthogonalisation settings, across
parameters and param groups, into buckets (`make_buckets`). Each bucket is one ``(N, A, B)``
tensor: the step writes V straight into its slots in the compute dtype (`Bucket.slots`: never
materialised in float32 and concatenated), orthogonalises it with one call, and takes each
weight's result back as soon as its last block is done (`Results`).

What a step does that depends only on its weights' shapes, options, devices and (over several
ranks) placements is its `StepStructure`, built once and cached (`StructureCache`): the units
of work (`Unit`: a weight, or over several ranks a piece of one), the buckets of the units this
process orthogonalises, and where each weight's result applies. In one process every weight
is one unit, orthogonalised here; over several ranks the distribution layer says which units
there are and which this rank owns (`muonclip.optim.multiprocess.Exchange.plan`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..ortho import METHODS
from ._matrices import MatrixSpec, matrix_spec
from .workspace import Workspace, workspace_for

STRUCTURAL_OPTIONS = ("method", "ns_steps", "orth_dtype", "eps", "ns_coefficients", "flatten", "split_sizes",
                      "transposed", "split_groups", "adjust_lr_fn")
"""The group options that change a step's buckets or scales (lr, weight decay, momentum and
Nesterov do not: they are read every step)."""


def frozen(v: Any) -> Any:
    """``v`` with lists turned into tuples (hashable, comparable)."""
    return tuple(frozen(x) for x in v) if isinstance(v, (list, tuple)) else v


def options_key(group: Mapping[str, Any]) -> tuple:
    """The group's `STRUCTURAL_OPTIONS`, hashable."""
    return tuple(frozen(group.get(o)) for o in STRUCTURAL_OPTIONS)


@dataclass
class Bucket:
    """Same-shape matrix blocks with the same settings: one ``orthogonalize`` call.

    Attributes:
        A, B: the shape of each matrix.
        device, method, steps, dtype, eps, coefficients: where and how it is orthogonalised
            (a param group's ``method``, ``ns_steps``, ``orth_dtype``, ``eps``,
            ``ns_coefficients``).
        workspace: the workspace its tensors come from and that orthogonalises it
            (`muonclip.optim.workspace.Workspace`, the one for ``device``).
        entries: ``(item, block)`` of each slot, in order.
        specs: each slot's item's `MatrixSpec`.
    """

    A: int
    B: int
    device: torch.device
    method: str
    steps: int | None
    dtype: torch.dtype | None
    eps: float
    coefficients: tuple[float, float, float] | None
    workspace: Workspace | None = None
    entries: list[tuple[int, int]] = field(default_factory=list)
    specs: list[MatrixSpec] = field(default_factory=list)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the bucket is written and orthogonalised in."""
        return self.dtype or METHODS[self.method].default_dtype

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(N, A, B)``: every slot's matrices stacked."""
        return (sum(s.batch for s in self.specs), self.A, self.B)

    def empty(self) -> Tensor:
        """An uninitialised bucket from its workspace."""
        return self.workspace.empty("input", self.shape, self.compute_dtype, self.device)

    def orthogonalize(self, V: Tensor, reuse_result: bool) -> Tensor:
        """Its workspace's ``orthogonalize`` of the filled bucket ``V`` with the bucket's settings."""
        return self.workspace.orthogonalize(V, self.method, self.steps, self.dtype, eps=self.eps,
                                          coefficients=self.coefficients, reuse_result=reuse_result)

    def slots(self, V: Tensor) -> Iterator[tuple[int, int, Tensor]]:
        """``(item, block, slot)`` of every slot of ``V``, the slot laid out like
        ``spec.block(t, block)`` of a tensor ``t`` of the item's shape (`MatrixSpec.slot`)."""
        for (k, b), spec, dst in zip(self.entries, self.specs, V.split([s.batch for s in self.specs])):
            yield k, b, spec.slot(dst, b)


def make_buckets(specs: Sequence[MatrixSpec], groups: Sequence[Mapping[str, Any]], devices: Sequence[torch.device],
                 owned: Iterable[int], workspace: Workspace) -> list[Bucket]:
    """The buckets of the ``owned`` items (item k: ``specs[k]``, its param group ``groups[k]``, on
    ``devices[k]``): blocks bucketed by shape and orthogonalisation settings, in item order, each
    with ``workspace``'s workspace for its device (`muonclip.optim.workspace.workspace_for`)."""
    buckets: dict[tuple, Bucket] = {}
    for k in owned:
        spec, g = specs[k], groups[k]
        for b in range(spec.n_blocks):
            fields = (spec.block_rows(b), spec.cols, devices[k], g["method"], g["ns_steps"], g["orth_dtype"], g["eps"],
                      g["ns_coefficients"])
            bucket = buckets.get(frozen(fields))
            if bucket is None:
                bucket = buckets[frozen(fields)] = Bucket(*fields, workspace=workspace_for(workspace, devices[k]))
            bucket.entries.append((k, b))
            bucket.specs.append(spec)
    return list(buckets.values())


class Results:
    """Each item's result, from its blocks' results as buckets finish.

    `add` returns an item's result, in its stored shape and the compute dtype, once its last
    block is in: a view into the bucket's result when the item is one block, else its blocks
    copied into a new tensor. With ``reuse_result`` (the workspace may overwrite a bucket's result
    storage with the next bucket's) a block of an item that is still incomplete is copied.
    """

    def __init__(self, specs: Sequence[MatrixSpec], reuse_result: bool) -> None:
        self._specs = specs
        self._reuse = reuse_result
        self._pieces: dict[int, list[Tensor | None]] = {}

    def add(self, k: int, b: int, result: Tensor) -> Tensor | None:
        """Block ``b`` of item ``k`` is ``result`` (``(E, rows_b, B)``); item k's whole result
        when this was its last block, else None."""
        spec = self._specs[k]
        if spec.n_blocks == 1:
            return spec.slot(result, 0)
        pieces = self._pieces.setdefault(k, [None] * spec.n_blocks)
        missing = sum(p is None for p in pieces) - 1
        pieces[b] = result.clone() if self._reuse and missing else result
        if missing:
            return None
        del self._pieces[k]
        out = torch.empty(spec.shape, dtype=result.dtype, device=result.device)
        for i, r in enumerate(pieces):
            spec.block(out, i).copy_(spec.slot(r, i))
        return out

    def of(self, bucket: Bucket, O: Tensor) -> Iterator[tuple[int, Tensor]]:
        """``(item, result)`` of every item that ``O``, the bucket's result, completes."""
        for (k, b), r in zip(bucket.entries, O.split([s.batch for s in bucket.specs])):
            whole = self.add(k, b, r)
            if whole is not None:
                yield k, whole


Place = tuple[int, tuple[tuple[int, int, float], ...], int]
"""Where a weight's result applies on this process: ``(axis, ranges, offset)`` for
`muonclip.optim.functional.apply_blocks_` (its piece's rows start at ``offset`` along ``axis``)."""


@dataclass(frozen=True)
class Unit:
    """What one process orthogonalises as one piece of work: a weight whole, or (expert parallel)
    a piece of its experts.

    Attributes:
        k: the weight it belongs to (its index in the step).
        spec: its `MatrixSpec` (the piece's shape for an expert-parallel piece).
        experts: the rows of a per-expert buffer it covers (NorMuon's second moment): all, or
            the piece's experts.
        direct: its V is formed here, from this process's gradient and momentum, straight into
            the bucket (else the distribution layer assembles it from pieces:
            `muonclip.optim.multiprocess.Exchange.gather`).
    """

    k: int
    spec: MatrixSpec
    experts: slice = field(default_factory=lambda: slice(None))
    direct: bool = True


@dataclass
class StepStructure:
    """What a step does that depends only on its weights' shapes, options, devices and placements.

    Attributes:
        specs: each weight's `MatrixSpec`.
        units: the units of work (in one process one per weight, in weight order).
        buckets: the buckets of the units this process orthogonalises (`make_buckets`).
        places: each weight's `Place` (in one process ``(spec.axis, spec.ranges, 0)``).
        direct_blocks: per weight, the bucket slots whose V is formed here from its momentum
            (the step drops a weight's float32 momentum after the last).
        flops: Newton–Schulz flops this process runs in a step.
        total_flops: the same over every rank of the group (``flops`` in one process).
        routes: the distribution layer's plan of what moves where (`Exchange.plan`), None in one
            process.
    """

    specs: list[MatrixSpec]
    units: list[Unit]
    buckets: list[Bucket]
    places: list[Place]
    direct_blocks: list[int]
    flops: int
    total_flops: int
    routes: Any = None


def step_structure(live: Sequence[tuple[Mapping[str, Any], Tensor]], devices: Sequence[torch.device],
                   workspace: Workspace, plan: Any = None) -> StepStructure:
    """The `StepStructure` of the weights ``live`` (``(param group, parameter)``, this process's
    tensors on ``devices``), their buckets from ``workspace``: every weight one unit orthogonalised
    here, or, with ``plan`` (`muonclip.optim.multiprocess.Routes`, from ``Exchange.plan``), the
    units, owned units, places and flops it says."""
    specs = [matrix_spec(p.shape, g) for g, p in live]
    if plan is None:
        units = [Unit(k, spec) for k, spec in enumerate(specs)]
        owned: Sequence[int] = range(len(units))
        places = [(spec.axis, spec.ranges, 0) for spec in specs]
        flops = total = sum(spec.flops for spec in specs)
    else:
        units, owned, places, flops, total = plan.units, plan.owned, plan.places, plan.flops, plan.total_flops
    buckets = make_buckets([u.spec for u in units], [live[u.k][0] for u in units], [devices[u.k] for u in units],
                           owned, workspace)
    direct = [0] * len(live)
    for u in owned:
        if units[u].direct:
            direct[units[u].k] += units[u].spec.n_blocks
    return StepStructure(specs, units, buckets, places, direct, flops, total, plan)


class StructureCache:
    """The step structures of the last few distinct steps, by key (least recently used dropped).

    The key is whatever decides a structure (`Muon` passes each weight's `options_key`, shape and
    device, the workspace, and over several ranks the layout the distribution layer reports):
    lr, weight decay, momentum and Nesterov are read every step and are not part of it.
    """

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._kept: OrderedDict[Hashable, StepStructure] = OrderedDict()

    def get(self, key: Hashable) -> StepStructure | None:
        """The structure kept for ``key``, or None."""
        st = self._kept.get(key)
        if st is not None:
            self._kept.move_to_end(key)
        return st

    def put(self, key: Hashable, st: StepStructure) -> None:
        """Keep ``st`` for ``key``."""
        self._kept[key] = st
        if len(self._kept) > self.size:
            self._kept.popitem(last=False)

    def latest(self) -> StepStructure | None:
        """The structure used last (None before any step)."""
        return next(reversed(self._kept.values()), None)

    def clear(self) -> None:
        """Forget every structure (after a state dict is loaded)."""
        self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)
