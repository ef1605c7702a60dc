"""QK-Clip under tensor parallelism: which attention heads this rank computes.

With column-parallel q/k projections (``ColwiseParallel``: the weight placed ``Shard(0)`` on
the tensor-parallel mesh, heads split across its ranks) each rank's attention computes a
contiguous range of heads, and its recorder receives maxima for those heads only
(docs/design.md, "Distributed Muon"). `record_local_heads` reads that range from the q weight's
placement and tells the recorder (`muonclip.attention.MaxLogitRecorder.shard_heads`), so that:

* the recorder keeps each head's maximum at its global position, ``-inf`` elsewhere;
* `MuonClip`'s one packed MAX all-reduce over every rank then gives each head the maximum
  over the ranks that computed it — the data-parallel and context-parallel ranks — while the
  tensor-parallel ranks that hold other heads contribute ``-inf``, the identity of MAX;
* the clip scales each head's rows where they live (`muonclip.common.dtensor.local_rows`).
"""

from __future__ import annotations

from torch import Tensor

from ..attention.running_max import MaxLogitRecorder
from ..common.dtensor import is_dtensor, piece_of


def local_heads(q_weight: Tensor, rows_per_head: int) -> range:
    """The query heads whose rows of ``q_weight`` this rank computes with.

    Args:
        q_weight: the query projection's weight ``(n_heads * rows_per_head, in)``: a plain
            tensor (every head), or a DTensor sharded on dim 0 over a 1-D tensor-parallel mesh
            (call this after ``parallelize_module`` and before ``fully_shard``).
        rows_per_head: rows of one head (``head_dim``; MLA: ``qk_nope_head_dim + qk_rope_head_dim``).

    Raises:
        ValueError: the weight is split inside a head, across columns, or on a mesh of more
            than one dimension.
    """
    rows = q_weight.shape[0]
    if rows % rows_per_head:
        raise ValueError(f"q weight has {rows} rows, not a multiple of rows_per_head={rows_per_head}")
    if not is_dtensor(q_weight):
        return range(rows // rows_per_head)
    mesh = q_weight.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"local_heads needs the q weight on its 1-D tensor-parallel mesh (got a {mesh.ndim}-D mesh): call it "
            "after parallelize_module and before fully_shard"
        )
    piece = piece_of(q_weight.shape, mesh.shape, mesh.get_coordinate(), q_weight.placements)
    r, cols = piece[0], piece[1]
    if cols != range(q_weight.shape[1]) or not isinstance(r, range) or r.start % rows_per_head \
            or len(r) % rows_per_head or not len(r):
        raise ValueError(
            f"the q weight {tuple(q_weight.shape)} placed {q_weight.placements} gives this rank rows {r} and columns "
            f"{cols}: not whole heads of {rows_per_head} rows. Column-parallel q/k (ColwiseParallel) with the number "
            "of heads divisible by the tensor-parallel size splits heads whole"
        )
    return range(r.start // rows_per_head, r.stop // rows_per_head)


def record_local_heads(recorder: MaxLogitRecorder, q_weight: Tensor, rows_per_head: int) -> range:
    """Make ``recorder`` record the heads `local_heads` finds; returns them."""
    if q_weight.shape[0] != recorder.n_heads * rows_per_head:
        raise ValueError(f"the q weight has {q_weight.shape[0]} rows, not the recorder's {recorder.n_heads} heads "
                         f"of {rows_per_head} rows")
    heads = local_heads(q_weight, rows_per_head)
    recorder.shard_heads(heads)
    return heads


__all__ = ["local_heads", "record_local_heads"]
