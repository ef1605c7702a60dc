"""Tensor parallelism for the reference GPT (`muonclip.models._gpt`), with torch's own plan styles.

`tensor_parallel` applies ``torch.distributed.tensor.parallel.parallelize_module`` to every
block, Megatron style: q, k, v and the MLP's ``c_fc`` column-parallel (``ColwiseParallel``:
weights ``Shard(0)``, so each rank computes whole heads), ``o_proj`` and ``c_proj``
row-parallel (``RowwiseParallel``: ``Shard(1)``, outputs summed across the mesh). MLA's
up-projections ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj`` are column-parallel too; its
down-projections (``q_a_proj``, ``kv_a_proj_with_mqa``, with the shared rotary key) stay
replicated; the shared rotary key's gradient, a partial sum on each rank, is summed over the
mesh by a hook. Embeddings, norms and the LM head stay replicated. Each attention recorder is
told which heads its rank computes (`muonclip.qkclip.tensor_parallel.record_local_heads`),
so `MuonClip` reduces and clips per global head. FSDP2 (``fully_shard`` on the data-parallel
mesh dimension) may be applied afterwards: 2-D FSDP2 x TP.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..qkclip.tensor_parallel import record_local_heads
from ._gpt import GPT, CausalSelfAttention


def tensor_parallel(model: GPT, tp_mesh: Any) -> GPT:
    """Shard ``model`` over the 1-D device mesh ``tp_mesh`` in place; returns it.

    Raises:
        ValueError: ``n_head`` (or ``n_kv_head``) not divisible by the mesh size, or a model
            with MoE feed-forward layers (not planned here).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    c = model.config
    kv = c.n_kv_head if c.attention == "mha" else c.n_head
    if c.n_head % tp or kv % tp:
        raise ValueError(
            f"tensor parallel size {tp} must divide n_head={c.n_head} and n_kv_head={kv}: each rank computes whole "
            "heads"
        )
    for block in model.blocks:
        attn = block.attn
        if isinstance(attn, CausalSelfAttention):
            plan: dict[str, Any] = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                    "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()}
        else:
            q = "q_b_proj" if hasattr(attn, "q_b_proj") else "q_proj"
            plan = {q: ColwiseParallel(), "kv_b_proj": ColwiseParallel(), "o_proj": RowwiseParallel()}
        parallelize_module(attn, tp_mesh, plan)
        mlp = block.mlp
        if not (isinstance(getattr(mlp, "c_fc", None), nn.Linear) and isinstance(getattr(mlp, "c_proj", None),
                                                                                  nn.Linear)):
            raise ValueError(f"tensor_parallel plans the dense MLP (c_fc, c_proj); got {type(mlp).__name__}")
        parallelize_module(mlp, tp_mesh, {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()})
        if isinstance(attn, CausalSelfAttention):
            record_local_heads(attn.recorder, attn.q_proj.weight, attn.head_dim)
        else:
            record_local_heads(attn.recorder, attn._q_weight_bias()[0], attn.nope + attn.rope)
            attn.kv_a_proj_with_mqa.register_forward_hook(_shared_rope_key_hook(tp_mesh, attn.rope))
    return model


def _shared_rope_key_hook(tp_mesh: Any, rope: int) -> Any:
    """A forward hook for MLA's ``kv_a_proj_with_mqa`` (output ``[c_kv | k_rope]``, replicated).

    Every rank uses the shared rotary key ``k_rope`` for its own heads only, so the gradient it
    gets back is this rank's share of the sum over heads: marked ``Partial`` on the way back and
    summed over the tensor-parallel mesh (DTensor's ``from_local`` backward). ``c_kv`` needs no
    hook: ``kv_b_proj`` (column-parallel) already sums its input's gradient.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    def hook(module: nn.Module, args: Any, out: Any) -> Any:
        c_kv, k_rope = out.split([out.shape[-1] - rope, rope], dim=-1)
        k_rope = DTensor.from_local(k_rope, tp_mesh, [Replicate()], run_check=False).to_local(
            grad_placements=[Partial()])
        return torch.cat([c_kv, k_rope], dim=-1)

    return hook


__all__ = ["tensor_parallel"]
