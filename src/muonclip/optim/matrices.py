"""How a parameter tensor is seen as a batch of matrices for orthogonalisation.

Declared, not guessed (docs/design.md, "Which matrices: fused projections, heads and routers"):

* 2-D ``(A, B)``: one matrix.
* ``flatten=True`` or ndim >= 4 (convolutions ``(out, in, kh, kw)``): one ``(out, in*kh*kw)``
  matrix; the update scale uses that flattened shape.
* 3-D without ``flatten`` (stacked MoE experts ``(E, A, B)``): E independent matrices.
* ``transposed=True`` (2-D, or 3-D stacked experts): the weight is stored ``(in, out)``, as in
  transformers' ``Conv1D`` (GPT-2) and its experts declared ``is_transposed`` (``(E, in,
  out)``, gpt-oss), so each matrix is the transpose ``(out, in)``: the update scale and
  ``split_sizes`` refer to that ``(out, in)`` matrix. (Orthogonalisation itself does not
  care: orth(W^T) = orth(W)^T.)
* ``split_sizes`` (fused projections): the rows of each matrix are cut into blocks of those
  sizes, each block orthogonalised on its own (``[q | k | v]`` of a fused QKV weight,
  ``[gate | up]`` of a fused MLP).
* ``split_groups=G`` with ``split_sizes`` (interleaved fused projections): the rows are G
  equal consecutive groups (e.g. attention heads), each cut by ``split_sizes``; block i is
  part i of every group, in group order. GPT-NeoX stores ``query_key_value`` as
  ``[h0: q k v | h1: q k v | ...]``: ``split_sizes=[d, d, d], split_groups=n_heads`` makes
  the q map (every head's first ``d`` rows) one block, k another, v a third. Interleaved
  gate/up rows ``[g0, u0, g1, u1, ...]`` are ``split_sizes=[1, 1], split_groups=I``.

A block is then ``G * split_sizes[i]`` rows of the matrix: `block_views` gives write-through
views of it shaped ``(E, G, split_sizes[i], B)``, `matrix_blocks` the ``(E, rows, B)``
matrices (views when ``G == 1``, gathered copies otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor


def matrix_view(t: Tensor, *, flatten: bool = False, transposed: bool = False) -> Tensor:
    """``t`` as a batch of matrices ``(E, A, B)`` (E = 1 unless stacked experts); a view of ``t``."""
    if t.ndim < 2:
        raise ValueError(f"a tensor of shape {tuple(t.shape)} is not a matrix")
    if transposed:
        if t.ndim not in (2, 3) or flatten:
            raise ValueError(f"transposed=True is for 2-D weights stored (in, out) or stacked 3-D (E, in, out), "
                             f"got shape {tuple(t.shape)}")
        return t.mT if t.ndim == 3 else t.mT.unsqueeze(0)
    if flatten or t.ndim >= 4:
        return t.reshape(1, t.shape[0], -1)
    return t if t.ndim == 3 else t.unsqueeze(0)


def block_views(
    t: Tensor,
    *,
    flatten: bool = False,
    split_sizes: Sequence[int] | None = None,
    transposed: bool = False,
    split_groups: int = 1,
) -> list[Tensor]:
    """Write-through views of each matrix block of ``t``, shaped ``(E, G, s_i, B)``.

    ``G = split_groups`` and ``s_i = split_sizes[i]`` (one block of all rows without
    ``split_sizes``). ``block.flatten(1, 2)`` is the block's ``(E, G * s_i, B)`` matrix, its
    rows in group order. ``t`` must be contiguous so that writes land in it (momentum and
    update buffers are). Raises ValueError when the sizes do not fit the row count.
    """
    m = matrix_view(t, flatten=flatten, transposed=transposed)
    rows = m.shape[1]
    if split_sizes is None:
        if split_groups != 1:
            raise ValueError(f"split_groups={split_groups} needs split_sizes (the parts of each group)")
        return [m.unsqueeze(1)]
    _check_sizes(list(split_sizes), split_groups, rows, tuple(m.shape[1:]))
    g = m.unflatten(1, (split_groups, rows // split_groups))  # (E, G, S, B): always a view
    out, a = [], 0
    for s in split_sizes:
        out.append(g[:, :, a : a + s])
        a += s
    return out


def matrix_blocks(
    t: Tensor,
    *,
    flatten: bool = False,
    split_sizes: Sequence[int] | None = None,
    transposed: bool = False,
    split_groups: int = 1,
) -> list[Tensor]:
    """The matrix blocks of ``t`` as a list of batches ``(E, A_i, B)``.

    With ``split_groups == 1`` these are views of ``t`` (``t`` contiguous: writes go through;
    with ``transposed`` strided views of its transpose); with ``split_groups > 1`` each block
    gathers rows from every group, so it is a copy (`block_views` gives the write-through
    form). Raises ValueError when ``split_sizes`` do not add up to the row count.
    """
    blocks = block_views(t, flatten=flatten, split_sizes=split_sizes, transposed=transposed,
                         split_groups=split_groups)
    return [b.squeeze(1) if split_groups == 1 else b.flatten(1, 2) for b in blocks]


def block_rows(rows: int, split_sizes: Sequence[int] | None = None,
               split_groups: int = 1) -> list[list[tuple[int, int]]]:
    """Each block's rows of a matrix with ``rows`` rows, as half-open ranges in group order.

    ``[[(0, rows)]]`` without ``split_sizes``; block i is ``[(g S + a_i, g S + a_i + s_i)
    for g < G]`` with ``S = rows / G`` and ``a_i`` the sum of the sizes before it.
    """
    if split_sizes is None:
        return [[(0, rows)]]
    period = rows // split_groups
    out, a = [], 0
    for s in split_sizes:
        out.append([(g * period + a, g * period + a + s) for g in range(split_groups)])
        a += s
    return out


def matrix_rows(
    shape: Sequence[int], flatten: bool = False, split_sizes: Sequence[int] | None = None,
    transposed: bool = False, split_groups: int = 1,
) -> tuple[int, list[list[tuple[int, int]]], int, int]:
    """How a parameter of global ``shape`` is cut into matrices, stated as row ranges.

    Mirrors `matrix_blocks` without touching data, so that the optimizer knows each block's
    shape and update scale, and a rank holding only some rows (FSDP2) which matrix block each
    of its rows belongs to.

    Returns:
        ``(axis, blocks, cols, batch)``: block k is the rows ``blocks[k]`` (half-open ranges
        ``[a, b)``, one per group of an interleaved layout, in group order; one range
        otherwise) along ``axis`` of the parameter (0 for 2-D and flattened weights, 1 for
        stacked experts ``(E, A, B)`` and for ``transposed`` 2-D weights stored ``(in, out)``,
        whose matrix rows are the stored columns, 2 for ``transposed`` stacked experts
        ``(E, in, out)``); each block has ``cols`` columns and ``batch`` matrices (E for
        stacked experts, else 1).
    """
    if transposed:
        axis, rows, cols = len(shape) - 1, shape[-1], shape[-2]
        batch = shape[0] if len(shape) == 3 else 1
    elif flatten or len(shape) >= 4 or len(shape) == 2:
        axis, rows, batch = 0, shape[0], 1
        cols = 1
        for s in shape[1:]:
            cols *= s
    else:
        axis, batch, rows, cols = 1, shape[0], shape[1], shape[2]
    return axis, block_rows(rows, split_sizes, split_groups), cols, batch


def _check_sizes(split_sizes: list[int], split_groups: int, rows: int, shape: tuple[int, ...]) -> None:
    if isinstance(split_groups, bool) or not isinstance(split_groups, int) or split_groups < 1:
        raise ValueError(f"split_groups must be an int >= 1, got {split_groups!r}")
    if any(isinstance(s, bool) or int(s) != s or s <= 0 for s in split_sizes) or not split_sizes:
        raise ValueError(f"split_sizes {split_sizes} must be positive integers")
    if sum(split_sizes) * split_groups != rows:
        where = f" x split_groups={split_groups}" if split_groups != 1 else ""
        raise ValueError(
            f"split_sizes {split_sizes}{where} must add up to the {rows} rows of a matrix of shape {shape}"
        )


def check_matrix_options(
    shape: Sequence[int], flatten: bool, split_sizes: Sequence[int] | None, transposed: bool = False,
    split_groups: int = 1,
) -> None:
    """Raise ValueError if ``flatten``/``split_sizes``/``transposed``/``split_groups`` cannot apply to a
    tensor of ``shape``."""
    if len(shape) < 2:
        raise ValueError(f"a tensor of shape {tuple(shape)} is not a matrix")
    if transposed and (len(shape) not in (2, 3) or flatten):
        raise ValueError(
            f"transposed=True is for 2-D weights stored (in, out) or stacked 3-D (E, in, out) (transformers' Conv1D "
            f"and is_transposed experts), got shape {tuple(shape)}{' with flatten=True' if flatten else ''}"
        )
    if split_sizes is None:
        if split_groups != 1:
            raise ValueError(f"split_groups={split_groups} needs split_sizes (the parts of each group)")
        return
    if transposed:
        rows = shape[-1]
    elif len(shape) == 3 and not flatten:
        rows = shape[1]
    else:
        rows = shape[0]
    _check_sizes(list(split_sizes), split_groups, rows, tuple(shape))
