"""Which modules of a transformers model are softmax attention, and the head layout of each.

**Softmax attention, per module.** A module is a softmax-attention layer when its class calls
transformers' attention interface (``ALL_ATTENTION_FUNCTIONS``: the source of the class says so,
`dispatches_attention`); those are the layers the ``"muonclip"`` attention function serves. In a
hybrid model the other token mixers (linear attention, Kimi-Linear's KDA, Mamba, short
convolutions) compute no softmax over q·k, so there is no max logit to clip: `mixers_without_attention`
lists them (modules with a ``layer_idx`` and no softmax attention in or above them), and
`muonclip.integrations.hf.attach` skips and reports them.

**Head counts, per module.** Query heads, key heads and head size come from the module itself
(``num_heads``, ``num_key_value_heads``, ``num_key_value_groups``, ``head_dim``), the config only
where the module holds none: layers of one model may differ (MiMo-V2-Flash's sliding-window
layers have twice the key heads of its full-attention layers).

**Layouts** (`layout_of`), checked against the weights by `muonclip.qkclip.AttentionLayer.check`:

* Llama / Mistral / Qwen2 style (``q_proj``, ``k_proj``): `MHALayout` when key heads = query
  heads, else `GQALayout` (exact per-head policy by default); q/k biases are part of the layout.
* BERT style (``query``, ``key``) and CTRL (``Wq``, ``Wk``): the same, under those names
  (`PROJECTION_PAIRS`).
* Fused projections, for the classes whose row order is known (a fused projection of any other
  class is refused: its order is not stated): Phi-3 style ``qkv_proj`` (rows ``[q | k | v]``,
  `FUSED_QKV_CLASSES`) and GPT-2's ``c_attn`` (a ``Conv1D`` stored ``(in, out)``; a
  cross-attention layer's queries come from ``q_attn`` and its ``c_attn`` holds ``[k | v]``;
  `C_ATTN_CLASSES`) as `Rows` ranges of one weight; GPT-NeoX / Pythia's ``query_key_value``
  (q, k and v interleaved per head) and CodeGen's ``qkv_proj`` (``[q v k]`` per model-parallel
  partition) as `StridedRows`.
* peft adapters (`muonclip.integrations.hf_adapters`): a DoRA projection's rows are its
  magnitude vector, a ``modules_to_save`` projection's its trainable copy, a plain LoRA
  projection's its frozen base weight (which MuonClip refuses to write, saying why).
* A projection clamped after the fact (DBRX's ``clip_qkv``): ValueError — a rescaled row is
  clamped again.
* DeepSeek-V3 MLA (``kv_b_proj``): `MLALayout` on ``q_b_proj`` (or ``q_proj`` without a query
  LoRA) and ``kv_b_proj``; the shared rotary key and V are never touched.
* A normalisation of q/k after the projection (QK-norm of Qwen3, Gemma 3, OLMo 2; Llama 4's L2
  ``qk_norm``; Phi's ``qk_layernorm``; ...): ValueError naming it — scaling W_q/W_k does not
  change normalised q/k (`muonclip.qkclip.qknorm`). Norms stated to sit elsewhere are allowed:
  MLA's ``q_a_layernorm`` / ``kv_a_layernorm`` feed the scaled projections, the norms of
  `OUTPUT_NORMS` act on the attention's output (DiffLlama's ``groupnorm``, BitNet's
  ``attn_sub_norm``), and the modules of `SELECTION_CHILDREN` only pick keys (the indexer of
  DeepSeek sparse attention).
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

from torch import Tensor, nn

from ..qkclip.layouts import GQALayout, MHALayout, MLALayout, Rows, StridedRows
from ..qkclip.qknorm import check_no_qk_norm
from .hf_adapters import projection_rows, unwrap

Layout = MHALayout | GQALayout | MLALayout

PROJECTION_PAIRS = (("q_proj", "k_proj"), ("query", "key"), ("Wq", "Wk"))
"""Names of separate query / key projections (Llama style, BERT style, CTRL)."""

PER_HEAD_QKV_CLASSES = ("GPTNeoXAttention",)
"""Attention classes whose ``query_key_value`` holds ``[q k v]`` per head, heads one after another."""

FUSED_QKV_CLASSES = ("Phi3Attention", "Phi4MultimodalAttention", "PhimoeAttention")
"""Attention classes whose ``qkv_proj`` holds the rows ``[q | k | v]``."""

C_ATTN_CLASSES = ("GPT2Attention", "GPTBigCodeAttention")
"""Attention classes whose ``c_attn`` holds ``[q | k | v]`` (``[k | v]`` for cross-attention, queries in ``q_attn``)."""

PARTITIONED_QKV_CLASSES = {"CodeGenAttention": "mp_num"}
"""Attention classes whose ``qkv_proj`` holds ``[q v k]`` per model-parallel partition (the attribute
holding the number of partitions): CodeGen's ``[p0: q v k | p1: q v k | ...]``, heads in partition order."""

OUTPUT_NORMS: dict[str, tuple[str, ...]] = {
    "DiffLlamaAttention": ("groupnorm",),
    "BitNetAttention": ("attn_sub_norm",),
}
"""Attention class -> children that normalise the attention's *output* (after the softmax and V),
hence cannot undo a rescaling of W_q/W_k (each one's family is a supported row of the family table,
``tests/test_qkclip_families.py``: its clip is exact)."""

SELECTION_CHILDREN = ("indexer",)
"""Children that pick which keys a query sees (DeepSeek sparse attention's indexer) from their own
projections and norms: they never rescale the q and k of the logits."""


@cache
def _class_dispatches(cls: type) -> bool:
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if "ALL_ATTENTION_FUNCTIONS" in source:
            return True
    return False


def dispatches_attention(module: nn.Module) -> bool:
    """Whether ``module``'s class (or a base class) calls transformers' attention interface
    (``ALL_ATTENTION_FUNCTIONS``), read from its source: a softmax-attention layer that the
    ``"muonclip"`` attention function can serve."""
    return _class_dispatches(type(module))


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every softmax-attention module of ``model`` (`dispatches_attention`,
    with a ``layer_idx``), in module order."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "layer_idx") and dispatches_attention(m)]


def mixers_without_attention(model: nn.Module, attention: list[str]) -> list[tuple[str, str]]:
    """``(name, class name)`` of the token mixers with no softmax attention: modules with a
    ``layer_idx`` that are not attention modules (``attention``: their names), contain none and sit
    in none, and contain no other such module (the innermost one is listed)."""
    indexed = [n for n, m in model.named_modules() if hasattr(m, "layer_idx") and n not in attention]

    def related(a: str, b: str) -> bool:
        return a == b or a.startswith(b + ".") or b.startswith(a + ".")

    out = []
    for name in indexed:
        if any(related(name, a) for a in attention):
            continue
        if any(other.startswith(name + ".") for other in indexed):
            continue
        out.append((name, type(model.get_submodule(name)).__name__))
    return out


def _linear(module: nn.Module, attr: str, name: str) -> nn.Module:
    lin = getattr(module, attr, None)
    if isinstance(lin, nn.Module):
        lin = unwrap(lin, name, attr)  # peft's modules_to_save: the trainable copy
    if not isinstance(getattr(lin, "weight", None), Tensor) or lin.weight.ndim != 2:
        raise ValueError(
            f"attention layer '{name}' ({type(module).__name__}): its projection '{attr}' ({type(lin).__name__}) has "
            "no weight matrix, so no head layout muonclip knows applies. State the layout yourself: "
            "MuonClip(model, layers=[AttentionLayer(name, GQALayout(...), recorder)])"
        )
    return lin


def heads_of(module: nn.Module, config: Any) -> tuple[int, int, int]:
    """``(query heads, key heads, head dim)`` of an attention module: from the module, else its config."""
    n_heads = getattr(module, "num_heads", None) or getattr(module, "num_attention_heads", None) \
        or config.num_attention_heads
    n_heads = int(n_heads)
    n_kv = getattr(module, "num_key_value_heads", None)
    if n_kv is None and getattr(module, "num_key_value_groups", None):
        n_kv = n_heads // int(module.num_key_value_groups)
    if n_kv is None:
        n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(module, "head_dim", None) or getattr(module, "head_size", None) \
        or getattr(config, "head_dim", None)
    return n_heads, int(n_kv), int(head_dim or config.hidden_size // n_heads)


def _make_layout(q_w, k_w, q_b, k_b, n_heads: int, n_kv: int, head_dim: int, gqa_policy: str) -> MHALayout | GQALayout:
    if n_kv == n_heads:
        return MHALayout(q_w, k_w, n_heads, head_dim, q_bias=q_b, k_bias=k_b)
    return GQALayout(q_w, k_w, n_heads, n_kv, head_dim, q_bias=q_b, k_bias=k_b, policy=gqa_policy)


def _no_layout(name: str, module: nn.Module) -> ValueError:
    found = ", ".join(f"{n} ({type(c).__name__})" for n, c in module.named_children()) or "none"
    return ValueError(
        f"attention layer '{name}' ({type(module).__name__}) has no q_proj/k_proj, fused qkv_proj/c_attn, GPT-NeoX "
        f"query_key_value or MLA q_b_proj/kv_b_proj whose head layout muonclip knows (its children: {found}), so "
        "which rows of which weights make each head's q and k is not stated. State it yourself: "
        "MuonClip(model, layers=[AttentionLayer(name, GQALayout(...), recorder)]), using muonclip.qkclip.Rows / "
        "StridedRows for the rows of a fused weight"
    )


def _mla_layout(name: str, module: nn.Module, config: Any) -> MLALayout:
    n_heads = int(getattr(module, "num_heads", None) or config.num_attention_heads)
    q_name = next((a for a in ("q_b_proj", "q_proj") if getattr(module, a, None) is not None), None)
    if q_name is None:  # the queries come from a projection of another layout (e.g. fused with a gate)
        raise _no_layout(name, module)
    q_w, q_b = projection_rows(_linear(module, q_name, name), name, q_name)
    kv_w, kv_b = projection_rows(_linear(module, "kv_b_proj", name), name, "kv_b_proj")
    return MLALayout(
        q_weight=q_w,
        n_heads=n_heads,
        qk_nope_head_dim=int(module.qk_nope_head_dim),
        qk_rope_head_dim=int(module.qk_rope_head_dim),
        kv_b_weight=kv_w,
        v_head_dim=int(module.v_head_dim),
        q_bias=q_b,
        kv_b_bias=kv_b,
    )


def _rows(t: Tensor | None, start: int, stop: int, transposed: bool = False) -> Rows | None:
    return None if t is None else Rows(t, start, stop, transposed=transposed and t.ndim == 2)


def _fused_layout(name: str, module: nn.Module, config: Any, gqa_policy: str) -> MHALayout | GQALayout:
    """Phi-3 ``qkv_proj`` (rows ``[q | k | v]``) or GPT-2 ``c_attn`` (Conv1D, columns ``[q | k | v]``)."""
    n_heads, n_kv, head_dim = heads_of(module, config)
    nq, nk = n_heads * head_dim, n_kv * head_dim
    if getattr(module, "qkv_proj", None) is not None:
        f = _linear(module, "qkv_proj", name)
        q_w, q_b = _rows(f.weight, 0, nq), _rows(f.bias, 0, nq)
        k_w, k_b = _rows(f.weight, nq, nq + nk), _rows(f.bias, nq, nq + nk)
    else:
        f = _linear(module, "c_attn", name)
        transposed = type(f).__name__ == "Conv1D"  # GPT-2's Conv1D stores (in, out); a Linear (out, in)
        if getattr(module, "is_cross_attention", False):  # queries from q_attn, c_attn = [k | v]
            q = _linear(module, "q_attn", name)
            q_w, q_b = _rows(q.weight, 0, nq, transposed), _rows(q.bias, 0, nq)
            k_w, k_b = _rows(f.weight, 0, nk, transposed), _rows(f.bias, 0, nk)
        else:
            q_w, q_b = _rows(f.weight, 0, nq, transposed), _rows(f.bias, 0, nq)
            k_w, k_b = _rows(f.weight, nq, nq + nk, transposed), _rows(f.bias, nq, nq + nk)
    return _make_layout(q_w, k_w, q_b, k_b, n_heads, n_kv, head_dim, gqa_policy)


def _partitioned_qkv_layout(name: str, module: nn.Module, config: Any, parts_attr: str) -> MHALayout:
    """CodeGen ``qkv_proj``: per partition p of ``local = n_heads * d / parts`` rows, ``[q v k]``."""
    f = _linear(module, "qkv_proj", name)
    n_heads, _, d = heads_of(module, config)
    parts = int(getattr(module, parts_attr))
    local = n_heads * d // parts

    def blocks(t: Tensor | None, start: int) -> StridedRows | None:
        return None if t is None else StridedRows(t, start, local, 3 * local, parts)

    return MHALayout(blocks(f.weight, 0), blocks(f.weight, 2 * local), n_heads, d, q_bias=blocks(f.bias, 0),
                     k_bias=blocks(f.bias, 2 * local))


def _per_head_qkv_layout(name: str, module: nn.Module, config: Any) -> MHALayout:
    """GPT-NeoX ``query_key_value``: rows ``[h*3d, h*3d+d)`` are head h's q, the next ``d`` its k."""
    f = _linear(module, "query_key_value", name)
    n_heads, _, d = heads_of(module, config)

    def blocks(t: Tensor | None, start: int) -> StridedRows | None:
        return None if t is None else StridedRows(t, start, d, 3 * d, n_heads)

    return MHALayout(blocks(f.weight, 0), blocks(f.weight, d), n_heads, d, q_bias=blocks(f.bias, 0),
                     k_bias=blocks(f.bias, d))


def layout_of(name: str, module: nn.Module, config: Any, gqa_policy: str = "per_head") -> Layout:
    """The head layout of attention module ``name`` (module docstring).

    Raises:
        ValueError: a q/k normalisation after the projections (naming it), or no projections
            whose layout is known (naming the module's children).
    """
    children = dict(module.named_children())
    mla = "kv_b_proj" in children
    harmless = [children[a] for a in ("q_a_layernorm", "kv_a_layernorm") if mla and a in children]
    harmless += [children[a] for a in OUTPUT_NORMS.get(type(module).__name__, ()) if a in children]
    harmless += [m for a in SELECTION_CHILDREN if a in children for m in children[a].modules()]
    check_no_qk_norm(name, module, harmless)
    cls = type(module).__name__
    clamp = getattr(module, "clip_qkv", None)
    if clamp is not None:
        raise ValueError(
            f"attention layer '{name}' ({cls}) clamps q, k and v to [-{clamp}, {clamp}] after the projection "
            "(clip_qkv): a rescaled row is clamped again, so QK-Clip's factor would not reach the logits exactly. "
            "Train it with plain muonclip.Muon, or use a config without clip_qkv."
        )
    if mla:
        return _mla_layout(name, module, config)
    if cls in PER_HEAD_QKV_CLASSES and "query_key_value" in children:
        return _per_head_qkv_layout(name, module, config)
    if cls in PARTITIONED_QKV_CLASSES and "qkv_proj" in children:
        return _partitioned_qkv_layout(name, module, config, PARTITIONED_QKV_CLASSES[cls])
    for q_name, k_name in PROJECTION_PAIRS:
        if q_name in children and k_name in children:
            q_w, q_b = projection_rows(_linear(module, q_name, name), name, q_name)
            k_w, k_b = projection_rows(_linear(module, k_name, name), name, k_name)
            n_heads, n_kv, head_dim = heads_of(module, config)
            return _make_layout(q_w, k_w, q_b, k_b, n_heads, n_kv, head_dim, gqa_policy)
    if (cls in FUSED_QKV_CLASSES and "qkv_proj" in children) or (cls in C_ATTN_CLASSES and "c_attn" in children):
        return _fused_layout(name, module, config, gqa_policy)
    fused = [a for a in ("qkv_proj", "c_attn", "Wqkv", "query_key_value", "qkv") if a in children]
    if fused:
        raise ValueError(
            f"attention layer '{name}' ({cls}) has a fused projection '{fused[0]}' whose row order (which rows are "
            "each head's q and k) muonclip has not verified for this class, so no head layout muonclip knows "
            "applies. State it yourself: MuonClip(model, layers=[AttentionLayer(name, GQALayout(Rows(...), "
            "Rows(...), ...), recorder)]) with muonclip.qkclip.Rows / StridedRows"
        )
    raise _no_layout(name, module)


__all__ = [
    "C_ATTN_CLASSES", "FUSED_QKV_CLASSES", "OUTPUT_NORMS", "PARTITIONED_QKV_CLASSES", "PER_HEAD_QKV_CLASSES",
    "PROJECTION_PAIRS", "SELECTION_CHILDREN", "Layout", "attention_modules", "dispatches_attention", "heads_of",
    "layout_of", "mixers_without_attention",
]
