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
* the clip scales each head's rows where they live (`muonclip.common._dtensor.local_rows`).
"""

from __future__ import annotations

from torch import Tensor

from ..attention._recorder import MaxLogitRecorder
from ..common._dtensor import is_dtensor, piece_of


def local_heads(q_weight: Tensor, rows_per_unit: int, heads_per_unit: int = 1, *,
                mesh_dim: str | None = None) -> range:
    """The query heads whose rows of ``q_weight`` this rank computes with.

    Args:
        q_weight: the query projection's weight ``(units * rows_per_unit, in)`` (or a fused
            projection's holding the queries): a plain tensor (every head), or a DTensor
            sharded on dim 0 over the tensor-parallel mesh dimension.
        rows_per_unit: rows of one unit of the weight: one head (``head_dim``; MLA:
            ``qk_nope_head_dim + qk_rope_head_dim``), or one group of a fused projection holding
            ``heads_per_unit`` query heads (torchtitan's ``wqkv``: a key/value group,
            ``(heads_per_kv + 2) * head_dim`` rows).
        heads_per_unit: query heads per unit (default 1).
        mesh_dim: the name of the tensor-parallel dimension of the weight's mesh (torchtitan:
            ``"tp"``; the other dimensions, FSDP2's, are gathered before the forward): a weight
            whose mesh has no such dimension computes every head. Default None: the weight's
            mesh must be 1-D (call this after ``parallelize_module`` and before ``fully_shard``).

    Raises:
        ValueError: the weight is split inside a unit, across columns, or (``mesh_dim`` None)
            on a mesh of more than one dimension.
    """
    rows = q_weight.shape[0]
    if rows % rows_per_unit:
        raise ValueError(f"q weight has {rows} rows, not a multiple of rows_per_unit={rows_per_unit}")
    every = range(rows // rows_per_unit * heads_per_unit)
    if not is_dtensor(q_weight):
        return every
    mesh = q_weight.device_mesh
    if mesh_dim is None:
        if mesh.ndim != 1:
            raise ValueError(
                f"local_heads needs the q weight on its 1-D tensor-parallel mesh (got a {mesh.ndim}-D mesh): call it "
                "after parallelize_module and before fully_shard, or name the mesh's tensor-parallel dimension "
                "(mesh_dim=)"
            )
        d = 0
    else:
        names = mesh.mesh_dim_names or ()
        if mesh_dim not in names:
            return every
        d = names.index(mesh_dim)
    piece = piece_of(q_weight.shape, (mesh.shape[d],), (mesh.get_local_rank(d),), (q_weight.placements[d],))
    r, cols = piece[0], piece[1]
    if cols != range(q_weight.shape[1]) or not isinstance(r, range) or r.start % rows_per_unit \
            or len(r) % rows_per_unit or not len(r):
        raise ValueError(
            f"the q weight {tuple(q_weight.shape)} placed {q_weight.placements[d]} on the tensor-parallel mesh gives "
            f"this rank rows {r} and columns {cols}: not whole units of {rows_per_unit} rows ({heads_per_unit} query "
            "head(s) each). Column-parallel projections (ColwiseParallel) split heads whole when the number of heads "
            "(of key/value groups, for a fused projection) is a multiple of the tensor-parallel size"
        )
    return range(r.start // rows_per_unit * heads_per_unit, r.stop // rows_per_unit * heads_per_unit)


def record_local_heads(recorder: MaxLogitRecorder, q_weight: Tensor, rows_per_head: int) -> range:
    """Make ``recorder`` record the heads `local_heads` finds; returns them."""
    if q_weight.shape[0] != recorder.n_heads * rows_per_head:
        raise ValueError(f"the q weight has {q_weight.shape[0]} rows, not the recorder's {recorder.n_heads} heads "
                         f"of {rows_per_head} rows")
    heads = local_heads(q_weight, rows_per_head)
    recorder.shard_heads(heads)
    return heads


__all__ = ["local_heads", "record_local_heads"]
