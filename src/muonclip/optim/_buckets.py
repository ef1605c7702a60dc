"""The structure of a Muon step: units of work, buckets of same-shape matrix blocks, where results apply.

A Muon step cuts each weight into its matrix blocks (`muonclip.optim._matrices.MatrixSpec`: a
2-D weight is one, stacked experts ``(E, A, B)`` are E, a fused weight with ``split_sizes`` one
per part) and groups the blocks of equal shape and orthogonalisation settings, across
parameters and param groups, into buckets (`make_buckets`). Each bucket is one ``(N, A, B)``
tensor: the step writes V straight into its slots in the compute dtype (`Bucket.slots`: never
materialised in float32 and concatenated), orthogonalises it with one call, and takes each
weight's result back as soon as its last block is done (`Results`).

**Chunks.** A bucket is orthogonalised in runs of at most a bound's worth of matrices (`Chunk`,
`chunk_plan`): on a CPU, `STEP_CHUNK_BYTES` caps the bytes of the four tensors of a run (its
V, its result and Newton–Schulz's two ``m x m`` temporaries: each at most a quarter of the
bound, `chunk_limit`), so the step's working set, and the buffers a workspace keeps for them
during the step (one per tensor, grown to the largest run, whatever order the buckets come in),
stay under that bound whatever the model's width or depth. A stack of experts is cut between
experts where a run is full (in one process: each run's experts are applied to their part of
the weight as the run ends); a slot that cannot be cut (one matrix, a fused block of a stack, a
unit of a multi-rank step) is never split, so a run is over the bound only when one such slot
alone is.

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
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Any

import torch
from torch import Tensor

from ..ortho import METHODS, resolve_orth_dtype
from ._matrices import WHOLE_MATRIX, MatrixSpec, matrix_spec
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


STEP_CHUNK_BYTES: dict[str, int] = {"cpu": 16 * 2**20}
"""The most bytes the tensors of one orthogonalisation call of a step take, per device type (a
quarter each for V, its result, the quintic's S and P: `chunk_limit`); a device type not listed
takes each bucket whole.

CPU, 16 MiB: the step's own working set should be small beside the state it saves over AdamW
(a float32 momentum, 4 bytes per hidden parameter against AdamW's 8: at 25M parameters 97 MiB,
the bound a sixth of it), and a CPU gains nothing from a wider batch once one run's products
fill its cores: at that bound a run holds 14 of 384 x 384 matrices in bfloat16, 4 of 512 x 512 in
float32, one of 2048 x 512 (docs/benchmarks.md measures the step's speed and peak against the
whole-bucket step). On a GPU the width of a batched product is what fills the device, and its
caching allocator already holds the memory between steps: the bucket stays whole there.

Read when a step's structure is built (`step_structure`, cached by the optimizer): a change
applies to the structures built after it; `step_structure`'s ``chunk_bytes`` overrides it.
"""

CALL_TENSORS = 4
"""The tensors of one orthogonalisation call that the bound shares: V, its result, S and P."""


def matrix_bytes(A: int, B: int, dtype: torch.dtype) -> int:
    """Bytes of one ``A x B`` matrix in ``dtype``: its share of V and of the result, the largest
    of a call's four tensors (S and P take ``m x m``, m the smaller side)."""
    return A * B * dtype.itemsize


@dataclass(frozen=True)
class Chunk:
    """The matrices of a bucket orthogonalised in one call.

    Attributes:
        parts: ``(slot, lo, hi)``: the matrices ``[lo, hi)`` of the bucket's slot ``slot`` (an
            expert range of a stack; ``(0, batch)``: the whole slot), in bucket order.
        size: the number of matrices.
    """

    parts: tuple[tuple[int, int, int], ...]
    size: int


def chunk_plan(batches: Sequence[int], limit: int | None, splittable: Sequence[bool] = ()) -> list[Chunk]:
    """The bucket of slots of ``batches`` matrices each cut into chunks of at most ``limit``
    matrices (None: one chunk, the whole bucket).

    The chunks are filled in slot order up to ``ceil(N / ceil(N / limit))`` matrices each (as
    many chunks as ``limit`` needs, near-equal in size). A slot marked in ``splittable`` (a stack
    of experts in one block, in one process) is cut between its matrices where a chunk is full;
    any other slot goes whole into a chunk with room for it, or starts a new one: a slot of more
    than ``limit`` matrices that cannot be cut is a chunk alone.
    """
    N = sum(batches)
    if limit is None or N <= limit:
        return [Chunk(tuple((j, 0, e) for j, e in enumerate(batches)), N)]
    target = -(-N // -(-N // limit))
    chunks: list[Chunk] = []
    parts: list[tuple[int, int, int]] = []
    size = 0
    for j, e in enumerate(batches):
        split, lo = j < len(splittable) and splittable[j], 0
        while lo < e:
            take = min(e - lo, target - size) if split else e
            if size and (take == 0 or size + take > target):  # full, or no room for a whole slot
                chunks.append(Chunk(tuple(parts), size))
                parts, size = [], 0
                continue
            parts.append((j, lo, lo + take))
            size, lo = size + take, lo + take
    chunks.append(Chunk(tuple(parts), size))
    return chunks


STACK_BYTES = 2**20
"""The most bytes of one float32 stack of the step's element-wise passes over small weights
(twice that for float64): the gradients, momenta or weights of a run of whole 2-D weights of a
plain bucket with the same settings (`stack_runs`), each pass then one call for the run instead
of one per weight (`muonclip.optim.functional.StepMomenta.write_plain`,
`muonclip.optim.functional.apply_plain`). A weight larger than this runs alone; the step holds at
most two such stacks at a time besides its buckets."""


def stack_runs(keys: Sequence[Any], numel: int) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` of each run of consecutive equal ``keys`` of matrices of ``numel`` elements,
    at most `STACK_BYTES` of float32 each (a None key is a run of its own)."""
    lo, n, most = 0, len(keys), STACK_BYTES // (4 * numel)
    for i in range(1, n + 1):
        if i == n or i - lo >= most or keys[lo] is None or keys[i] != keys[lo]:
            yield lo, i
            lo = i


def chunk_limit(A: int, B: int, dtype: torch.dtype, device: torch.device,
                bounds: Mapping[str, int] | None = None) -> int | None:
    """Matrices per orthogonalisation call for ``A x B`` matrices in ``dtype`` on ``device``: the
    most whose V fits in a quarter of the device type's bound (``bounds``, default
    `STEP_CHUNK_BYTES`), at least 1; None (the whole bucket) for a device type without one.

    Each of a call's `CALL_TENSORS` tensors (V, its result, S, P; none larger than V) then takes
    at most a quarter of the bound, so buffers kept per tensor and grown to the largest call
    (`muonclip.fast.BufferedWorkspace`) stay under the bound together, however the buckets'
    shapes mix: a bound on the sum of one call's tensors would not hold for them (a wide
    bucket's V and a square one's S, each the largest of its kind, can exceed it).
    """
    bound = (STEP_CHUNK_BYTES if bounds is None else bounds).get(device.type)
    return None if bound is None else max(1, bound // (CALL_TENSORS * matrix_bytes(A, B, dtype)))


@dataclass
class Bucket:
    """Same-shape matrix blocks with the same settings: one ``orthogonalize`` call.

    Attributes:
        A, B: the shape of each matrix.
        device, method, steps, dtype, eps, coefficients: where and how it is orthogonalised
            (a param group's ``method``, ``ns_steps``, ``orth_dtype`` resolved for the device
            (`muonclip.ortho.resolve_orth_dtype`), ``eps``, ``ns_coefficients``).
        workspace: the workspace its tensors come from and that orthogonalises it
            (`muonclip.optim.workspace.Workspace`, the one for ``device``).
        entries: ``(item, block)`` of each slot, in order.
        specs: each slot's item's `MatrixSpec`.
        chunks: the `Chunk` runs the step orthogonalises it in (`chunk_plan`; set by
            `step_structure`; default: the whole bucket).
        plain: every slot is one 2-D ``(A, B)`` weight as stored (no blocks, not transposed), so
            each of V's matrices is a slot as it is (kept by `make_buckets`).
        stored: per slot, whether its ``(E, A, B)`` part of V is its item as stored (a whole stack
            of experts, not transposed), so it is its slot as it is.
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
    chunks: list[Chunk] = field(default_factory=list)
    plain: bool = True
    stored: list[bool] = field(default_factory=list)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the bucket is written and orthogonalised in."""
        return self.dtype or METHODS[self.method].default_dtype

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(N, A, B)``: every slot's matrices stacked."""
        return (sum(s.batch for s in self.specs), self.A, self.B)

    def empty(self, chunk: Chunk | None = None) -> Tensor:
        """An uninitialised bucket (or ``chunk`` of it: ``(chunk.size, A, B)``) from its workspace."""
        shape = self.shape if chunk is None else (chunk.size, self.A, self.B)
        return self.workspace.empty("input", shape, self.compute_dtype, self.device)

    def whole(self) -> Chunk:
        """The whole bucket as one `Chunk`."""
        return chunk_plan([s.batch for s in self.specs], None)[0]

    def orthogonalize(self, V: Tensor, reuse_result: bool) -> Tensor:
        """Its workspace's ``orthogonalize`` of the filled bucket ``V`` with the bucket's settings."""
        return self.workspace.orthogonalize(V, self.method, self.steps, self.dtype, eps=self.eps,
                                          coefficients=self.coefficients, reuse_result=reuse_result)

    def slots(self, V: Tensor, chunk: Chunk | None = None) -> Iterator[tuple[int, int, slice | None, Tensor]]:
        """``(item, block, experts, slot)`` of every slot (or part of one) of ``V``, the bucket or
        its ``chunk``: ``experts`` None for a whole slot, laid out like ``spec.block(t, block)`` of
        a tensor ``t`` of the item's shape (`MatrixSpec.slot`); else the expert range
        ``[lo, hi)`` of a stack cut by the chunk, laid out like ``t[lo:hi]``."""
        return self._cut(V, (chunk or self.whole()).parts)

    def items(self, chunk: Chunk | None = None) -> list[int]:
        """The item of each slot of the bucket (or of ``chunk``), in order."""
        return [self.entries[j][0] for j, _, _ in (chunk or self.whole()).parts]

    def _cut(self, V: Tensor, parts: tuple[tuple[int, int, int], ...]
             ) -> Iterator[tuple[int, int, slice | None, Tensor]]:
        for (j, lo, hi), dst in zip(parts, V.split([hi - lo for _, lo, hi in parts])):
            (k, b), spec = self.entries[j], self.specs[j]
            if hi - lo == spec.batch:
                yield k, b, None, dst if self.stored[j] else spec.slot(dst, b)
            else:  # a part of a stack of experts in one block (`step_structure` lets no other slot be cut)
                yield k, b, slice(lo, hi), dst.mT if spec.transposed else dst


def make_buckets(specs: Sequence[MatrixSpec], groups: Sequence[Mapping[str, Any]], devices: Sequence[torch.device],
                 owned: Iterable[int], workspace: Workspace) -> list[Bucket]:
    """The buckets of the ``owned`` items (item k: ``specs[k]``, its param group ``groups[k]``, on
    ``devices[k]``): blocks bucketed by shape and orthogonalisation settings, in item order, each
    with ``workspace``'s workspace for its device (`muonclip.optim.workspace.workspace_for`)."""
    buckets: dict[tuple, Bucket] = {}
    for k in owned:
        spec, g = specs[k], groups[k]
        for b in range(spec.n_blocks):
            dtype = resolve_orth_dtype(g["orth_dtype"], g["method"], devices[k])  # "auto": per device
            fields = (spec.block_rows(b), spec.cols, devices[k], g["method"], g["ns_steps"], dtype, g["eps"],
                      g["ns_coefficients"])
            bucket = buckets.get(frozen(fields))
            if bucket is None:
                bucket = buckets[frozen(fields)] = Bucket(*fields, workspace=workspace_for(workspace, devices[k]))
            bucket.entries.append((k, b))
            bucket.specs.append(spec)
            bucket.plain = bucket.plain and spec.shape == (bucket.A, bucket.B) and not spec.transposed
            bucket.stored.append(spec.shape == (spec.batch, bucket.A, bucket.B) and not spec.transposed)
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
        """Block ``b`` of item ``k`` is ``result``, laid out as its slot (`Bucket.slots`); item
        k's whole result when this was its last block, else None."""
        spec = self._specs[k]
        if spec.n_blocks == 1:
            return result
        pieces = self._pieces.setdefault(k, [None] * spec.n_blocks)
        missing = sum(p is None for p in pieces) - 1
        pieces[b] = result.clone() if self._reuse and missing else result
        if missing:
            return None
        del self._pieces[k]
        out = torch.empty(spec.shape, dtype=result.dtype, device=result.device)
        for i, r in enumerate(pieces):
            spec.block(out, i).copy_(r)
        return out

    def of(self, bucket: Bucket, O: Tensor, chunk: Chunk | None = None) -> Iterator[tuple[int, slice | None, Tensor]]:
        """``(item, experts, result)`` of every item that ``O``, the result of the bucket (or of its
        ``chunk``), completes (``experts`` None), and of every expert range of a stack that the
        chunk cut (``experts``: the range, the result laid out like ``t[experts]``)."""
        if bucket.plain:  # one block each: every slot is its item's result
            return zip(bucket.items(chunk), repeat(None), O.unbind(0))
        return self._completed(bucket.slots(O, chunk))

    def _completed(self, slots: Iterator[tuple[int, int, slice | None, Tensor]]
                   ) -> Iterator[tuple[int, slice | None, Tensor]]:
        for k, b, experts, r in slots:
            if experts is not None:
                yield k, experts, r
                continue
            whole = self.add(k, b, r)
            if whole is not None:
                yield k, None, whole


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

    def chunks(self) -> Iterator[tuple[Bucket, Chunk]]:
        """``(bucket, chunk)`` of every chunk of every bucket, in order: one orthogonalisation
        call each (`chunk_plan`)."""
        for bucket in self.buckets:
            for chunk in bucket.chunks or [bucket.whole()]:
                yield bucket, chunk

    def end_step(self) -> None:
        """The step is over: ``release()`` of each workspace that ran its buckets, where it has
        one (`muonclip.optim.workspace.Workspace`: it may free what it kept for the step)."""
        for workspace in {id(b.workspace): b.workspace for b in self.buckets}.values():
            release = getattr(workspace, "release", None)
            if release is not None:
                release()


def step_structure(live: Sequence[tuple[Mapping[str, Any], Tensor]], devices: Sequence[torch.device],
                   workspace: Workspace, plan: Any = None, chunk_bytes: Mapping[str, int] | None = None
                   ) -> StepStructure:
    """The `StepStructure` of the weights ``live`` (``(param group, parameter)``, this process's
    tensors on ``devices``), their buckets from ``workspace``: every weight one unit orthogonalised
    here, or, with ``plan`` (`muonclip.optim.multiprocess.Routes`, from ``Exchange.plan``), the
    units, owned units, places and flops it says. Each bucket is cut into chunks of at most
    ``chunk_bytes[device type]`` bytes (`chunk_limit`; default `STEP_CHUNK_BYTES`)."""
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
    for bucket in buckets:  # stacks cut between experts only in one process (a rank scatters whole units)
        bucket.chunks = chunk_plan([s.batch for s in bucket.specs],
                                   chunk_limit(bucket.A, bucket.B, bucket.compute_dtype, bucket.device, chunk_bytes),
                                   [plan is None and s.n_blocks == 1 and s.batch > 1 for s in bucket.specs])
    direct = [0] * len(live)
    for u in owned:
        if units[u].direct:
            direct[units[u].k] += units[u].spec.n_blocks
    return StepStructure(specs, units, buckets, places, direct, flops, total, plan)


def weight_structure(param: Tensor, workspace: Workspace, *, method: str, ns_steps: int | None,
                     orth_dtype: torch.dtype | str | None, eps: float,
                     ns_coefficients: tuple[float, float, float] | None, adjust_lr_fn: str | None,
                     scale: float | None = None) -> StepStructure:
    """The `StepStructure` of one weight in one process, seen as `muonclip.Muon` sees it in a group
    without matrix keys (`muonclip.optim._matrices.WHOLE_MATRIX`), orthogonalised with the group
    keys given; ``scale``: the update scale of every row, instead of ``adjust_lr_fn``'s."""
    group = {**WHOLE_MATRIX, "method": method, "ns_steps": ns_steps, "orth_dtype": orth_dtype, "eps": eps,
             "ns_coefficients": ns_coefficients, "adjust_lr_fn": adjust_lr_fn}
    st = step_structure([(group, param)], [param.device], workspace)
    if scale is None:
        return st
    spec = st.specs[0]
    return replace(st, places=[(spec.axis, ((0, spec.rows, scale),), 0)])


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

    def clear(self) -> None:
        """Forget every structure (after a state dict is loaded)."""
        self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)
