"""Buckets: same-shape matrix blocks orthogonalised in one call.

A Muon step cuts each weight into its matrix blocks (`muonclip.optim.matrices.MatrixSpec`: a
2-D weight is one, stacked experts ``(E, A, B)`` are E, a fused weight with ``split_sizes`` one
per part) and groups the blocks of equal shape and orthogonalisation settings, across
parameters and param groups, into buckets (`make_buckets`). Each bucket is one ``(N, A, B)``
tensor: the step writes V straight into its slots in the compute dtype (`Bucket.slots`: never
materialised in float32 and concatenated), orthogonalises it with one call, and takes each
weight's result back as soon as its last block is done (`Results`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..ortho import METHODS
from .matrices import MatrixSpec
from .precision import resolve_orth_dtype

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
            (a param group's ``method``, ``ns_steps``, ``orth_dtype`` resolved for the device
            (`muonclip.optim.precision`), ``eps``, ``ns_coefficients``).
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

    def empty(self, backend: Any) -> Tensor:
        """An uninitialised bucket from ``backend`` (`muonclip.optim.backend.Backend`)."""
        return backend.empty("input", self.shape, self.compute_dtype, self.device)

    def orthogonalize(self, V: Tensor, backend: Any, reuse_result: bool) -> Tensor:
        """``backend.orthogonalize`` of the filled bucket ``V`` with the bucket's settings."""
        return backend.orthogonalize(V, self.method, self.steps, self.dtype, eps=self.eps,
                                     coefficients=self.coefficients, reuse_result=reuse_result)

    def slots(self, V: Tensor) -> Iterator[tuple[int, int, Tensor]]:
        """``(item, block, slot)`` of every slot of ``V``, the slot laid out like
        ``spec.block(t, block)`` of a tensor ``t`` of the item's shape (`MatrixSpec.slot`)."""
        for (k, b), spec, dst in zip(self.entries, self.specs, V.split([s.batch for s in self.specs])):
            yield k, b, spec.slot(dst, b)


def make_buckets(specs: Sequence[MatrixSpec], groups: Sequence[Mapping[str, Any]], devices: Sequence[torch.device],
                 owned: Iterable[int]) -> list[Bucket]:
    """The buckets of the ``owned`` items (item k: ``specs[k]``, its param group ``groups[k]``, on
    ``devices[k]``): blocks bucketed by shape and orthogonalisation settings, in item order."""
    buckets: dict[tuple, Bucket] = {}
    for k in owned:
        spec, g = specs[k], groups[k]
        for b in range(spec.n_blocks):
            dtype = resolve_orth_dtype(g["orth_dtype"], g["method"], devices[k])  # "auto": per device
            fields = (spec.block_rows(b), spec.cols, devices[k], g["method"], g["ns_steps"], dtype, g["eps"],
                      g["ns_coefficients"])
            bucket = buckets.setdefault(frozen(fields), Bucket(*fields))
            bucket.entries.append((k, b))
            bucket.specs.append(spec)
    return list(buckets.values())


class Results:
    """Each item's result, from its blocks' results as buckets finish.

    `add` returns an item's result, in its stored shape and the compute dtype, once its last
    block is in: a view into the bucket's result when the item is one block, else its blocks
    copied into a new tensor. With ``reuse_result`` (the backend may overwrite a bucket's result
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


__all__ = ["STRUCTURAL_OPTIONS", "Bucket", "Results", "frozen", "make_buckets", "options_key"]
