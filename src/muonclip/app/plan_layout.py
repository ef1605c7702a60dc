"""Who holds which piece of which weight, on a mesh given by its degrees (``muonclip plan``).

A mesh is ``pp x dp_replicate x dp_shard x cp x tp`` ranks (`Mesh`), with expert parallelism
``ep`` carved out of the data-parallel ranks, numbered as torchtitan numbers them (pipeline
outermost, tensor parallel innermost). Every pipeline stage holds its own layers
(`stage_of_layers`) and plans its step over its own ranks, as the step does once each stage's
parameters live on the stage's own data/tensor-parallel group: a stage's figures never involve
another stage's ranks. Within a stage, what each rank holds (`stage_pieces`, the pieces of
`muonclip.common._dtensor.piece_of`, the function the step itself uses):

* **dense weights** (everything but routed experts), on the stage's ``(dp_replicate, dp_shard x
  cp, tp)`` ranks: replicated over ``dp_replicate`` (DDP, or HSDP's replicas); sharded over
  ``dp_shard x cp`` by rows, as FSDP2's ``fully_shard`` does (``Shard(0)``; a column-parallel
  weight, already split by rows over ``tp``, gets FSDP2's strided shard); split over ``tp`` by its
  tensor-parallel role (column-parallel ``Shard(0)``, row-parallel ``Shard(1)``, else replicated);
* **routed experts** ``(E, ...)``, with ``ep > 1``: ``Shard(0)`` over ``ep`` ranks (whole experts),
  taken from the innermost data-parallel ranks (torchtitan: ``dp_shard x cp x tp``, its ``efsdp x
  ep``; under ZeRO-1 from ``dp_replicate``, Megatron's expert parallelism inside data
  parallelism); over the other ``dp_shard x cp x tp / ep`` ranks FSDP2 shards them like torchtitan
  does (by experts, or by rows, ``Shard(1)``, when that leaves a rank no expert); replicated over
  ``dp_replicate``. Routed experts are not split by tensor parallelism.
* **ZeRO-1** (``zero1``: ``dp_replicate`` is ZeRO-1 data parallelism, no ``dp_shard``/``tp``):
  parameters and gradients are replicated, the optimizer state is partitioned: each param group's
  weights flattened in optimizer order into one buffer, padded to a multiple of twice the ranks,
  cut into equal contiguous ranges (DeepSpeed's ZeRO-1 partition, `zero1_size`; the state covers
  the padding). A rank's piece of a weight is the
  part of it in its range (a range of the flattened weight, planned on the weight's flat view).
  Routed experts under ZeRO-1: ``ep`` ranks as above; the ``dp_replicate / ep`` ranks that hold
  the same experts deal them out by whole experts.

Checked against real steps (`tests/test_plan.py`: DDP, FSDP2 and FSDP2 x TP and HSDP as
``fully_shard`` and the reference GPT's tensor-parallel plan lay them out, EP as DTensors placed as
torchtitan's FSDP2 x EP places them, two pipeline stages of FSDP2 or of replicas under a
``torch.distributed.pipelining`` schedule, each stepping with ``process_group=`` its ranks, and
ZeRO-1 as DeepSpeed's ZeRO-1 partitions a model and drives `muonclip.Muon` over its partitions).
`stage_holdings` gives the same pieces as what the ranks hold of each weight, computed once per
distinct piece: what the plan of hundreds of ranks is made from.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from ..common._dtensor import Piece, piece_of
from ..distributed._plan import Held, holdings
from .plan_model import Weight


class MeshError(ValueError):
    """A mesh whose degrees do not fit together or do not fit the model."""


@dataclass(frozen=True)
class Mesh:
    """A mesh by its degrees (every one >= 1).

    Attributes:
        dp_replicate: data-parallel replicas (DDP; HSDP's replica groups; ZeRO-1 with ``zero1``).
        dp_shard: FSDP2 sharding (``fully_shard``).
        cp: context parallel (parameters sharded with ``dp_shard``, as torchtitan does).
        tp: tensor parallel.
        ep: expert parallel, carved from the data-parallel ranks.
        pp: pipeline stages.
        zero1: ``dp_replicate`` partitions the optimizer state (ZeRO-1) instead of replicating it.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1
    zero1: bool = False

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage."""
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def world(self) -> int:
        """Ranks in all."""
        return self.pp * self.stage_size

    def check(self) -> None:
        """Raise `MeshError` when the degrees do not fit together."""
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "ep", "pp"):
            if getattr(self, name) < 1:
                raise MeshError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.zero1 and (self.dp_shard * self.cp > 1 or self.tp > 1):
            raise MeshError("--zero1 partitions the optimizer state over --dp-replicate ranks that hold whole "
                            "parameters; it is not planned with --dp-shard, --cp or --tp (give --dp-replicate N "
                            "--zero1, or FSDP2's --dp-shard without --zero1)")
        pool = self.dp_replicate if self.zero1 else self.dp_shard * self.cp * self.tp
        if self.ep > 1 and pool % self.ep:
            where = "--dp-replicate" if self.zero1 else "--dp-shard x --cp x --tp"
            raise MeshError(f"--ep {self.ep} must divide {where} ({pool}): expert parallelism takes its ranks from "
                            "the data-parallel ranks")

    def describe(self) -> str:
        """E.g. ``PP4 x DP64 (ZeRO-1) x EP64 = 256 ranks``."""
        parts = [f"PP{self.pp}"] if self.pp > 1 else []
        if self.dp_replicate > 1:
            parts.append(f"DP{self.dp_replicate}" + (" (ZeRO-1)" if self.zero1 else
                                                     " (replicas)" if self.dp_shard * self.cp > 1 else " (DDP)"))
        if self.dp_shard > 1:
            parts.append(f"FSDP{self.dp_shard}")
        parts += [f"{k}{v}" for k, v in (("CP", self.cp), ("TP", self.tp), ("EP", self.ep)) if v > 1]
        return " x ".join(parts or ["1 rank"]) + f" = {self.world} ranks"


def stage_of_layers(n_layers: int, pp: int) -> list[int]:
    """The stage of each of ``n_layers`` layers over ``pp`` stages, torchtitan's default split
    (``generate_llm_fqn_per_model_part``): the embedding and the head count as one layer each,
    ``n_layers + 2`` split as evenly as possible, the first stages taking one more."""
    if pp == 1:
        return [0] * n_layers
    base, extra = divmod(n_layers + 2, pp)
    out: list[int] = []
    for s in range(pp):
        out += [s] * max(0, base + (s < extra) - (s == 0) - (s == pp - 1))
    if len(out) != n_layers or len(set(out)) != pp:
        raise MeshError(f"--pp {pp} leaves a pipeline stage without a layer: the model has {n_layers} layers "
                        "(the embedding and the head count as one each)")
    return out


def stage_of(w: Weight, stages: Sequence[int], pp: int) -> int:
    """The stage that holds ``w``: its layer's, the first for what comes before the layers, the last
    for what comes after."""
    if w.layer is not None:
        return stages[w.layer]
    return pp - 1 if w.after_layers else 0


def _strided(dim: int, factor: int) -> object:
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=factor)


def _dense(w: Weight, mesh: Mesh) -> tuple[tuple[int, ...], tuple[object, ...]]:
    """The stage's ranks as ``(dp_replicate, dp_shard x cp, tp)`` and ``w``'s placements there."""
    from torch.distributed.tensor import Replicate, Shard

    fsdp = mesh.dp_shard * mesh.cp
    role = w.tp if mesh.tp > 1 and len(w.shape) >= 2 else "replicate"
    tp_pl = Shard(0) if role == "colwise" else Shard(1) if role == "rowwise" else Replicate()
    if fsdp == 1:
        fsdp_pl = Replicate()
    else:
        fsdp_pl = _strided(0, mesh.tp) if role == "colwise" else Shard(0)
    return (mesh.dp_replicate, fsdp, mesh.tp), (Replicate(), fsdp_pl, tp_pl)


def _experts(w: Weight, mesh: Mesh) -> tuple[tuple[int, ...], tuple[object, ...]]:
    """The stage's ranks as ``(outer, efsdp, ep)`` and a stack of routed experts' placements."""
    from torch.distributed.tensor import Replicate, Shard

    if mesh.zero1:
        outer, inner = 1, mesh.dp_replicate // mesh.ep
    else:
        outer, inner = mesh.dp_replicate, mesh.dp_shard * mesh.cp * mesh.tp // mesh.ep
    if inner == 1:
        inner_pl = Replicate()
    elif mesh.zero1 or inner * mesh.ep <= w.shape[0]:
        inner_pl = _strided(0, mesh.ep)
    else:
        inner_pl = Shard(1)
    return (outer, inner, mesh.ep), (Replicate(), inner_pl, Shard(0))


def _grid_pieces(shape: tuple[int, ...], grid: tuple[int, ...], placements: tuple[object, ...],
                 name: str) -> list[Piece]:
    return [piece_of(shape, grid, coord, placements, name) for coord in itertools.product(*(range(n) for n in grid))]


def zero1_size(numel: int, ranks: int) -> int:
    """Elements of each rank's partition of a ZeRO-1 buffer of ``numel`` elements: DeepSpeed pads the
    buffer to a multiple of twice the ranks (``nccl_start_alignment_factor`` 2 times the
    data-parallel world, ``deepspeed/runtime/zero/stage_1_and_2.py`` and ``bf16_optimizer.py``) and
    cuts it into ``ranks`` equal partitions."""
    return 2 * -(-numel // (2 * ranks))


def _flat_ranges(weights: Sequence[Weight], ranks: int) -> list[list[tuple[int, range]]]:
    """Per weight of one ZeRO-1 buffer (`flat_partition`), ``(rank, range)`` of every rank holding
    some of it, ascending."""
    total = sum(w.numel for w in weights)
    size = zero1_size(total, ranks)
    out, start = [], 0
    for w in weights:
        end = start + w.numel
        out.append([(r, range(max(start, r * size) - start, min(end, (r + 1) * size) - start))
                    for r in range(start // size if size else 0, min(ranks, -(-end // size) if size else 0))
                    if max(start, r * size) < min(end, (r + 1) * size)])
        start = end
    return out


def flat_partition(weights: Sequence[Weight], ranks: int) -> list[list[Piece]]:
    """ZeRO-1's partition of ``weights`` (one param group, in order) over ``ranks``: the weights
    flattened into one buffer padded as DeepSpeed pads it (`zero1_size`), each rank a contiguous
    equal range; per weight, per rank, the range of the flattened weight it holds."""
    out = []
    for held in _flat_ranges(weights, ranks):
        pieces: list[Piece] = [(range(0),)] * ranks
        for r, rng in held:
            pieces[r] = (rng,)
        out.append(pieces)
    return out


def zero1_flat(w: Weight, mesh: Mesh) -> bool:
    """Whether ``w`` lives in a ZeRO-1 flat buffer on ``mesh`` (every weight under ``zero1`` but
    routed experts split by ``ep``)."""
    return mesh.zero1 and mesh.dp_replicate > 1 and not (w.expert and mesh.ep > 1)


def _layout(weights: Sequence[Weight], mesh: Mesh) -> tuple[list[tuple[int, ...]], list[object],
                                                             dict[int, list[int]]]:
    """Per weight, the shape it is planned on and its grid and placements (None: ZeRO-1's flat
    partition), and the members of each flat ZeRO-1 buffer (by param group)."""
    shapes: list[tuple[int, ...]] = []
    layouts: list[object] = []
    flat: dict[int, list[int]] = {}
    for i, w in enumerate(weights):
        if w.expert and mesh.ep > 1:
            layouts.append(_experts(w, mesh))  # under ZeRO-1 the ZeRO-1 ranks are the whole stage: (1, dp/ep, ep)
        elif zero1_flat(w, mesh):
            flat.setdefault(id(w.group), []).append(i)
            shapes.append((w.numel,))
            layouts.append(None)
            continue
        else:
            layouts.append(_dense(w, mesh))
        shapes.append(w.shape)
    return shapes, layouts, flat


def stage_pieces(weights: Sequence[Weight], mesh: Mesh) -> tuple[list[tuple[int, ...]], list[list[Piece]]]:
    """The shape each weight is planned on and every stage rank's piece of it.

    A weight is planned on its own shape, except a weight ZeRO-1 partitions, which is planned on
    its flattened shape ``(numel,)`` (its pieces are ranges of it). Each param group is one
    ZeRO-1 buffer (DeepSpeed flattens each group apart).
    """
    shapes, layouts, flat = _layout(weights, mesh)
    pieces: list[list[Piece]] = [[] if lay is None else _grid_pieces(w.shape, *lay, w.name)  # type: ignore[misc]
                                 for w, lay in zip(weights, layouts)]
    for members in flat.values():
        for i, got in zip(members, flat_partition([weights[i] for i in members], mesh.stage_size)):
            pieces[i] = got
    return shapes, pieces


def stage_holdings(weights: Sequence[Weight], mesh: Mesh) -> tuple[list[tuple[int, ...]], list[Held]]:
    """`stage_pieces` as what the ranks hold of each weight (`muonclip.distributed._plan.Held`:
    each distinct piece and its holders), without a list over the ranks per weight: weights of
    the same shape and placements share one (computed once), a ZeRO-1 weight lists only the ranks
    its elements fall in (its empty pieces left out)."""
    shapes, layouts, flat = _layout(weights, mesh)
    cache: dict[tuple[object, ...], Held] = {}
    held: list[Held] = []
    for w, lay in zip(weights, layouts):
        if lay is None:
            held.append({})
            continue
        key = (w.shape, *lay)  # type: ignore[misc]
        if key not in cache:
            cache[key] = holdings(_grid_pieces(w.shape, *lay, w.name))  # type: ignore[misc]
        held.append(cache[key])
    for members in flat.values():
        group = [weights[i] for i in members]
        for i, w, got in zip(members, group, _flat_ranges(group, mesh.stage_size)):
            held[i] = {(rng,): [r] for r, rng in got} if w.numel else holdings([(range(0),)] * mesh.stage_size)
    return shapes, held


def zero1_padding(weights: Sequence[Weight], mesh: Mesh) -> tuple[list[int], list[int]]:
    """Per stage rank, the padding elements of its ZeRO-1 partitions (`zero1_size`: a partition
    holds its share of the buffer, padding included, and the optimizer's state covers all of it),
    of the Muon param groups and of the others; zeros without ZeRO-1."""
    n = mesh.stage_size
    muon, other = [0] * n, [0] * n
    for members in _layout(weights, mesh)[2].values():
        total = sum(weights[i].numel for i in members)
        size = zero1_size(total, n)
        pad = muon if weights[members[0]].muon else other
        for r in range(n):
            pad[r] += size - max(0, min(total, (r + 1) * size) - r * size)
    return muon, other
