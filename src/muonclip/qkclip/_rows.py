"""The rows of a weight that a head layout names (`muonclip.qkclip.MHALayout` and the others).

A layout's weight or bias is a tensor whose rows are the heads' rows, or one of:

* `Rows` — a row range of the ``(out, in)`` projection matrix of a fused projection (one weight
  holding q, k and v, as Phi-3's ``qkv_proj`` or GPT-2's ``c_attn``), which may be stored
  transposed ``(in, out)`` (transformers' ``Conv1D``);
* `StridedRows` — equal blocks of rows at a fixed stride, for a fused weight that interleaves
  q, k and v per head (GPT-NeoX / Pythia's ``query_key_value``: ``[h0: q k v | h1: q k v | ...]``);
* `Magnitudes` — DoRA's magnitude vector, whose entry r stands for row r of the effective
  weight (the clip scales the magnitudes, never the frozen base weight).

`check_rows` refuses rows that do not fit the weight or the layout, saying which. Scaling them
is the layouts' (`muonclip.qkclip._layouts.scale_rows_`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Rows:
    """Rows ``[start, stop)`` of the ``(out, in)`` projection matrix held in ``tensor`` (fused QKV).

    Args:
        tensor: the parameter: a weight stored ``(out, in)``, or ``(in, out)`` with
            ``transposed=True`` (transformers' ``Conv1D``: GPT-2's ``c_attn``), or a 1-D bias.
        start: first row of the range (for a bias: first entry).
        stop: one past the last row.
        transposed: ``tensor`` is a 2-D weight stored ``(in, out)``, so the rows of the matrix
            are its columns (default False).
    """

    tensor: Tensor
    start: int
    stop: int
    transposed: bool = False

    @property
    def out_features(self) -> int:
        """Rows of the whole ``(out, in)`` matrix (entries of a bias)."""
        return self.tensor.shape[1] if self.transposed else self.tensor.shape[0]


@dataclass(frozen=True)
class StridedRows:
    """``count`` blocks of ``block`` consecutive rows of the ``(out, in)`` matrix in ``tensor``, block i
    starting at row ``start + i * stride``: one of q, k, v of a per-head interleaved fused weight.

    GPT-NeoX / Pythia's ``query_key_value`` holds, for head h, rows ``[h*3d, h*3d + d)`` of q,
    ``[h*3d + d, h*3d + 2d)`` of k and ``[h*3d + 2d, (h+1)*3d)`` of v (``d`` the head size), so its
    q rows are ``StridedRows(w, 0, d, 3 * d, n_heads)`` and its k rows
    ``StridedRows(w, d, d, 3 * d, n_heads)``; the layout's row r is row
    ``start + (r // block) * stride + r % block`` of the matrix.

    Args:
        tensor: the parameter: a weight stored ``(out, in)``, or ``(in, out)`` with
            ``transposed=True``, or a 1-D bias.
        start: first row of the first block.
        block: rows per block (> 0).
        stride: rows from the start of one block to the start of the next (>= ``block``).
        count: number of blocks (> 0).
        transposed: ``tensor`` is a 2-D weight stored ``(in, out)`` (default False).
    """

    tensor: Tensor
    start: int
    block: int
    stride: int
    count: int
    transposed: bool = False

    @property
    def out_features(self) -> int:
        """Rows of the whole ``(out, in)`` matrix (entries of a bias)."""
        return self.tensor.shape[1] if self.transposed else self.tensor.shape[0]

    @property
    def n_rows(self) -> int:
        """Rows in the set: ``count * block``."""
        return self.count * self.block

    def indices(self, device: torch.device | str | None = None) -> Tensor:
        """``(count * block,)`` int64: the matrix row of each of the set's rows, in order."""
        base = torch.arange(self.count, device=device) * self.stride + self.start
        return (base[:, None] + torch.arange(self.block, device=device)).reshape(-1)


@dataclass(frozen=True)
class Magnitudes:
    """The per-row magnitudes ``m`` of a weight-normalised projection, standing for its rows.

    DoRA (Liu et al. 2024, arXiv 2402.09353; peft's ``lora_magnitude_vector``) computes the
    effective weight ``W' = m * (W0 + s B A) / ||W0 + s B A||_row``: row r of ``W'`` is ``m[r]``
    times a unit row that does not depend on ``m``. Scaling ``m[r]`` by ``c`` therefore scales
    row r of ``W'`` (and of the projection's output, bias aside) by exactly ``c``, while the
    frozen ``W0`` and the factors ``A``, ``B`` stay untouched. A layout weight given as
    ``Magnitudes`` is clipped through these entries.

    Args:
        tensor: the 1-D ``(out_features,)`` magnitude vector.
    """

    tensor: Tensor

    @property
    def out_features(self) -> int:
        """Rows of the projection: entries of the vector."""
        return self.tensor.shape[0]


Weight = Tensor | Rows | StridedRows | Magnitudes


def tensor_of(t: Weight) -> Tensor:
    return t.tensor if isinstance(t, (Rows, StridedRows, Magnitudes)) else t


def _check_strided(name: str, t: StridedRows, rows: int, why: str, *, vector: bool) -> None:
    ndim = t.tensor.ndim
    if vector and (ndim != 1 or t.transposed):
        raise ValueError(f"{name} must be 1-D entries of a bias, got StridedRows of shape {tuple(t.tensor.shape)}")
    if not vector and ndim != 2:
        raise ValueError(f"{name} must be rows of a 2-D weight, got StridedRows of shape {tuple(t.tensor.shape)}")
    for k in ("start", "block", "stride", "count"):
        v = getattr(t, k)
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if k == "start" else 1):
            raise ValueError(f"{name}: StridedRows {k} must be an int >= {0 if k == 'start' else 1}, got {v!r}")
    if t.count > 1 and t.stride < t.block:
        raise ValueError(f"{name}: StridedRows blocks of {t.block} rows at stride {t.stride} overlap")
    last = t.start + (t.count - 1) * t.stride + t.block
    if last > t.out_features:
        raise ValueError(
            f"{name}: StridedRows ({t.count} blocks of {t.block} rows from row {t.start}, stride {t.stride}) end at "
            f"row {last}, past the {t.out_features} rows of a weight of shape {tuple(t.tensor.shape)}"
            f"{' stored (in, out)' if t.transposed else ''}"
        )
    if t.n_rows != rows:
        raise ValueError(
            f"{name} has {t.n_rows} rows ({t.count} blocks of {t.block}) but the stated head layout needs {rows} "
            f"({why}); check n_heads / n_kv_heads / head dims, or the blocks"
        )


def check_rows(name: str, t: Weight | None, rows: int, why: str, *, vector: bool = False) -> None:
    if t is None:
        return
    if isinstance(t, Magnitudes):
        if vector or t.tensor.ndim != 1:
            raise ValueError(f"{name}: Magnitudes stand for the rows of a weight and must be 1-D, got shape "
                             f"{tuple(t.tensor.shape)}{' given as a bias' if vector else ''}")
        if t.out_features != rows:
            raise ValueError(f"{name} has {t.out_features} magnitudes (rows) but the stated head layout needs {rows} "
                             f"({why}); check n_heads / n_kv_heads / head dims")
        return
    if isinstance(t, StridedRows):
        _check_strided(name, t, rows, why, vector=vector)
        return
    if isinstance(t, Rows):
        ndim = t.tensor.ndim
        if vector and (ndim != 1 or t.transposed):
            raise ValueError(f"{name} must be 1-D entries of a bias, got Rows of shape {tuple(t.tensor.shape)}")
        if not vector and ndim != 2:
            raise ValueError(f"{name} must be rows of a 2-D weight, got Rows of shape {tuple(t.tensor.shape)}")
        if not 0 <= t.start < t.stop <= t.out_features:
            raise ValueError(
                f"{name}: Rows [{t.start}, {t.stop}) do not fit the {t.out_features} rows of a weight of shape "
                f"{tuple(t.tensor.shape)}{' stored (in, out)' if t.transposed else ''}"
            )
        if t.stop - t.start != rows:
            raise ValueError(
                f"{name} has {t.stop - t.start} rows ([{t.start}, {t.stop})) but the stated head layout needs "
                f"{rows} ({why}); check n_heads / n_kv_heads / head dims, or the row range"
            )
        return
    if vector and t.ndim != 1:
        raise ValueError(f"{name} must be 1-D (a bias), got shape {tuple(t.shape)}")
    if not vector and t.ndim < 2:
        raise ValueError(f"{name} must be a weight matrix (>= 2-D), got shape {tuple(t.shape)}")
    if t.shape[0] != rows:
        raise ValueError(
            f"{name} has {t.shape[0]} rows but the stated head layout needs {rows} ({why}); "
            "check n_heads / n_kv_heads / head dims, or pass the right weight"
        )
