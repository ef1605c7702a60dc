"""Where QK-Clip and Muon find q, k and each head in torchtitan's models.

`attention_layers` finds every attention module of a torchtitan model (after torchtitan has
parallelised it: tensor parallel, activation checkpointing, FSDP2) and returns one
`muonclip.qkclip.AttentionLayer` per module, named by its canonical name (torchtitan's
checkpoint key form: ``layers.0.attention``), with its head layout:

* ``GQAttention`` with a fused ``FusedQKVLinear`` (llama3, the default ``fuse_qkv=True``):
  ``wqkv`` holds, per key/value group g, rows ``[q heads of g | k_g | v_g]`` (``heads_per_kv + 2``
  blocks of ``head_dim`` rows), so q and k are `muonclip.qkclip.StridedRows` of it: a
  `GQALayout` (``policy`` as given; `MHALayout` when every head has its own key head).
* ``GQAttention`` with separate ``wq``/``wk``/``wv`` (``QKVLinear``): the same layouts on those.
* DeepSeek-V3's MLA ``Attention``: `MLALayout` on ``wq`` (or ``wq_b`` with a query LoRA; rows
  ``[nope | rope]`` per head) and ``wkv_b`` (rows ``[k_nope | v]`` per head): K2's rule, q^C and
  k^C by ``sqrt(gamma)``, q^R by ``gamma``, the shared rotary key and V untouched.
* A q/k normalisation after the projection (Qwen3's ``q_norm``/``k_norm``): a ValueError:
  scaling W_q/W_k does not change normalised q/k, so QK-Clip cannot bound the logits.

Each layer's recorder lives on its inner attention (``muonclip_recorder``), which must be one of
`muonclip.integrations.torchtitan_attention`'s recording modules. Under tensor parallelism
(torchtitan's column-parallel ``wqkv``/``wq``: ``Shard(0)`` on the ``"tp"`` mesh dimension)
each rank computes whole heads; `muonclip.qkclip.tensor_parallel.local_heads` finds which from
the weight's ``"tp"`` mesh dimension, and the recorder keeps them at their global positions.

`muon_splits` gives `muonclip.param_groups` the ``split=`` that makes Muon see the fused
``wqkv`` as its q, k and v maps per key/value group (each head's rows with ``per_head``), and,
with ``per_head``, each MLA head's rows of ``wq``/``wq_b``/``wkv_b``. torchtitan's MoE experts
(``w1_EFD``, ``w2_EDF``, ``w3_EFD``: one ``(out, in)`` matrix per expert) are stacks Muon
orthogonalises expert by expert, and its router gate a matrix: `muonclip.param_groups`'s own rules.

`canonical_name` is torchtitan's checkpoint key of a parameter or module name (wrapper segments
``_checkpoint_wrapped_module``, ``_orig_mod``, ``_fsdp_wrapped_module`` removed), the form the
container puts in its param groups' ``param_names`` so that its flat optimizer state dict uses
torchtitan's keys.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.models.common.attention import FusedQKVLinear, GQAttention, QKVLinear

from ..attention._recorder import MaxLogitRecorder
from ..qkclip._layouts import AttentionLayer, GQALayout, MHALayout, MLALayout
from ..qkclip._rows import StridedRows
from ..qkclip.tensor_parallel import local_heads
from .torchtitan_attention import is_recording


def canonical_name(name: str) -> str:
    """torchtitan's checkpoint key form of a parameter or module name (wrapper segments removed)."""
    return canonical_fqn(name)


def _recorder(inner: nn.Module, name: str, n_heads: int) -> MaxLogitRecorder:
    if not is_recording(inner):
        raise ValueError(
            f"attention {name!r} runs {type(inner).__name__}, which records no max logits: build the model with "
            "muonclip.integrations.torchtitan.with_muonclip(config) (or set its inner_attention to "
            "RecordingSDPA / RecordingFlexAttention)"
        )
    rec = getattr(inner, "muonclip_recorder", None)
    if not isinstance(rec, MaxLogitRecorder) or rec.n_heads != n_heads:
        rec = MaxLogitRecorder(n_heads)
        inner.muonclip_recorder = rec
    return rec


def refusal(module: nn.Module) -> str | None:
    """Why QK-Clip cannot clip this attention module (None: it can): a q/k normalisation after the
    projections (Qwen3's ``q_norm``/``k_norm``) makes the logits independent of the scale of W_q and W_k."""
    if isinstance(module, GQAttention) and (module.q_norm is not None or module.k_norm is not None):
        return ("normalises q and k after their projections (Qwen3's q_norm/k_norm): scaling W_q and W_k does not "
                "change normalised q/k, so QK-Clip cannot bound its logits")
    return None


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(canonical name, module)`` of every attention module of a torchtitan model
    (``GQAttention``, DeepSeek-V3's MLA ``Attention``), in module order."""
    return [(canonical_name(n), m) for n, m in model.named_modules() if isinstance(m, GQAttention) or _is_mla(m)]


def _gqa_layer(name: str, m: GQAttention, policy: str) -> AttentionLayer:
    why = refusal(m)
    if why is not None:
        raise ValueError(f"attention {name!r} {why}. Train this model with plain Muon (--optimizer.name Muon)")
    hq, hkv, hd = m.n_heads, m.n_kv_heads, m.head_dim
    hpk = hq // hkv
    qkv = m.qkv_linear
    if isinstance(qkv, FusedQKVLinear):
        w, b = qkv.wqkv.weight, qkv.wqkv.bias
        stride = (hpk + 2) * hd
        q_w, k_w = StridedRows(w, 0, hpk * hd, stride, hkv), StridedRows(w, hpk * hd, hd, stride, hkv)
        q_b = None if b is None else StridedRows(b, 0, hpk * hd, stride, hkv)
        k_b = None if b is None else StridedRows(b, hpk * hd, hd, stride, hkv)
        heads = local_heads(w, stride, hpk, mesh_dim="tp")
    elif isinstance(qkv, QKVLinear):
        q_w, k_w, q_b, k_b = qkv.wq.weight, qkv.wk.weight, qkv.wq.bias, qkv.wk.bias
        heads = local_heads(q_w, hd, mesh_dim="tp")
    else:
        raise ValueError(f"attention {name!r}: unknown q/k/v projection {type(qkv).__name__}; give MuonClip the layers")
    if hq == hkv:
        layout: Any = MHALayout(q_w, k_w, hq, hd, q_b, k_b)
    else:
        layout = GQALayout(q_w, k_w, hq, hkv, hd, q_b, k_b, policy=policy)
    rec = _recorder(m.inner_attention, name, hq)
    if heads != rec.heads:
        rec.shard_heads(heads)
    return AttentionLayer(name, layout, rec)


def _mla_layer(name: str, m: nn.Module) -> AttentionLayer:
    q = m.wq if m.q_lora_rank == 0 else m.wq_b
    dq = m.qk_nope_head_dim + m.qk_rope_head_dim
    layout = MLALayout(q.weight, m.n_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.wkv_b.weight, m.v_head_dim,
                       q.bias, m.wkv_b.bias)
    rec = _recorder(m.inner_attention, name, m.n_heads)
    heads = local_heads(q.weight, dq, mesh_dim="tp")
    if heads != rec.heads:
        rec.shard_heads(heads)
    return AttentionLayer(name, layout, rec)


def _is_mla(m: nn.Module) -> bool:
    from torchtitan.models.deepseek_v3.model import Attention

    return isinstance(m, Attention)


def attention_sizes(module: nn.Module) -> tuple[int, int, int]:
    """``(heads, q/k head dim, v head dim)`` of an attention module of `attention_modules` (MLA: the
    query's nope + rope dims)."""
    if _is_mla(module):
        return module.n_heads, module.qk_nope_head_dim + module.qk_rope_head_dim, module.v_head_dim
    return module.n_heads, module.head_dim, module.head_dim


def attention_layers(model: nn.Module, *, gqa_policy: str = "per_head") -> list[AttentionLayer]:
    """One `AttentionLayer` per attention module of a (parallelised) torchtitan model; see the module docstring.

    Args:
        model: a torchtitan model (or one pipeline stage of it).
        gqa_policy: `GQALayout`'s policy for grouped-query attention (default ``"per_head"``:
            exact per head, shared keys untouched).

    Raises:
        ValueError: an attention with q/k normalisation (Qwen3), an inner attention that does
            not record, an unknown projection, or a tensor-parallel split inside a head.
    """
    return [_gqa_layer(name, m, gqa_policy) if isinstance(m, GQAttention) else _mla_layer(name, m)
            for name, m in attention_modules(model)]


def muon_splits(model: nn.Module, *, per_head: bool = False) -> dict[str, dict[str, Any]]:
    """``split=`` for `muonclip.param_groups`: parameter name -> ``{"split_sizes", "split_groups"}``.

    The fused ``wqkv`` always (``[q heads | k | v]`` per key/value group; each head its own
    block with ``per_head``); with ``per_head`` also separate ``wq``/``wk``/``wv`` per head and
    MLA's ``wq``/``wq_b`` (``[nope | rope]`` per head) and ``wkv_b`` (``[k_nope | v]`` per head).
    Names are ``model.named_parameters()``'s (wrappers included).
    """
    out: dict[str, dict[str, Any]] = {}
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(m, GQAttention):
            hq, hkv, hd = m.n_heads, m.n_kv_heads, m.head_dim
            qkv = m.qkv_linear
            if isinstance(qkv, FusedQKVLinear):
                sizes = [hd] * (hq // hkv) + [hd, hd] if per_head else [hq // hkv * hd, hd, hd]
                out[f"{prefix}qkv_linear.wqkv.weight"] = {"split_sizes": sizes, "split_groups": hkv}
            elif isinstance(qkv, QKVLinear) and per_head:
                out[f"{prefix}qkv_linear.wq.weight"] = {"split_sizes": [hd], "split_groups": hq}
                for p in ("wk", "wv"):
                    out[f"{prefix}qkv_linear.{p}.weight"] = {"split_sizes": [hd], "split_groups": hkv}
        elif per_head and _is_mla(m):
            q = "wq" if m.q_lora_rank == 0 else "wq_b"
            out[f"{prefix}{q}.weight"] = {"split_sizes": [m.qk_nope_head_dim + m.qk_rope_head_dim],
                                         "split_groups": m.n_heads}
            out[f"{prefix}wkv_b.weight"] = {"split_sizes": [m.qk_nope_head_dim + m.v_head_dim],
                                           "split_groups": m.n_heads}
    return out


__all__ = ["attention_layers", "attention_modules", "attention_sizes", "canonical_name", "muon_splits", "refusal"]
