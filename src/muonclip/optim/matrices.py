"""How a parameter tensor is seen as a batch of matrices for orthogonalisation.

Declared, not guessed (design.md 1.1):

* 2-D ``(A, B)``: one matrix.
* ``flatten=True`` or ndim >= 4 (convolutions ``(out, in, kh, kw)``): one ``(out, in*kh*kw)``
  matrix; the update scale uses that flattened shape.
* 3-D without ``flatten`` (stacked MoE experts ``(E, A, B)``): E independent matrices.
* ``split_sizes`` (fused QKV): the rows of each matrix are cut into blocks of those sizes, each
  block orthogonalised on its own.
* ``transposed=True`` (2-D only): the weight is stored as ``(in, out)``, as in transformers'
  ``Conv1D`` (GPT-2), so the matrix is its transpose ``(out, in)``: the update scale and
  ``split_sizes`` refer to that ``(out, in)`` matrix. (Orthogonalisation itself does not care:
  orth(W^T) = orth(W)^T.)
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor


def matrix_blocks(
    t: Tensor,
    *,
    flatten: bool = False,
    split_sizes: Sequence[int] | None = None,
    transposed: bool = False,
) -> list[Tensor]:
    """Views of ``t`` as a list of batches ``(E, A_i, B)`` (E = 1 unless stacked experts).

    ``t`` must be contiguous so that the views write through (momentum buffers and update
    buffers are). With ``transposed`` the views are of ``t``'s transpose (strided, still
    writing through). Raises ValueError when ``split_sizes`` do not add up to the row count.
    """
    if t.ndim < 2:
        raise ValueError(f"a tensor of shape {tuple(t.shape)} is not a matrix")
    if transposed:
        if t.ndim != 2 or flatten:
            raise ValueError(f"transposed=True applies to 2-D (in, out) weights, got shape {tuple(t.shape)}")
        m = t.mT.unsqueeze(0)
    elif flatten or t.ndim >= 4:
        m = t.reshape(1, t.shape[0], -1)
    elif t.ndim == 3:
        m = t
    else:
        m = t.unsqueeze(0)
    if split_sizes is None:
        return [m]
    rows = m.shape[1]
    if sum(split_sizes) != rows or any(s <= 0 for s in split_sizes):
        raise ValueError(
            f"split_sizes {list(split_sizes)} must be positive and add up to the {rows} rows of a "
            f"matrix of shape {tuple(m.shape[1:])}"
        )
    return list(m.split(list(split_sizes), dim=1))


def check_matrix_options(
    shape: Sequence[int], flatten: bool, split_sizes: Sequence[int] | None, transposed: bool = False
) -> None:
    """Raise ValueError if ``flatten``/``split_sizes``/``transposed`` cannot apply to a tensor of ``shape``."""
    if len(shape) < 2:
        raise ValueError(f"a tensor of shape {tuple(shape)} is not a matrix")
    if transposed and (len(shape) != 2 or flatten):
        raise ValueError(
            f"transposed=True is for 2-D weights stored as (in, out) (transformers' Conv1D), got shape "
            f"{tuple(shape)}{' with flatten=True' if flatten else ''}"
        )
    if split_sizes is not None:
        rows = shape[1] if (len(shape) == 3 and not flatten) or transposed else shape[0]
        if sum(split_sizes) != rows or any(int(s) <= 0 for s in split_sizes):
            raise ValueError(
                f"split_sizes {list(split_sizes)} must be positive and add up to the {rows} rows of "
                f"a parameter of shape {tuple(shape)}"
            )
