"""Which modules of a transformers model are softmax attention, and the head layout of each.

**Softmax attention, per module.** A module is a softmax-attention layer when its class calls
transformers' attention interface (``ALL_ATTENTION_FUNCTIONS``: the source of the class says so,
`dispatches_attention`); those are the layers the ``"muonclip"`` attention function serves. In a
hybrid model the other token mixers (linear attention, Kimi-Linear's KDA, Mamba, short
convolutions) compute no softmax over q·k, so there is no max logit to clip: `mixers_without_attention`
lists them (modules with a ``layer_idx`` and no softmax attention in or above them), and
`muonclip.integrations.hf.attach` skips and reports them.

**Layouts** (`layout_of`), from the family table (`muonclip.integrations.families`, read through
`muonclip.common.families`), checked against the weights by `muonclip.qkclip.AttentionLayer.check`.
Head counts come from the module, the config only where the module holds none
(`muonclip.common.family_readers.heads_of`):

* Separate projections (Llama / Mistral / Qwen2 style ``q_proj``, ``k_proj``; BERT style
  ``query``, ``key``; CTRL's ``Wq``, ``Wk``): `MHALayout` when key heads = query heads, else
  `GQALayout` (exact per-head policy by default); q/k biases are part of the layout.
* Fused projections, for the classes whose row order the table states (a fused projection of
  any other class is refused: its order is not stated): the rows of q and k as the table's
  `muonclip.common.family_readers.QKVRows` gives them — the same rows `muonclip.param_groups` splits
  into the q and k maps — as `Rows` ranges of one weight (Phi-3's ``qkv_proj``, GPT-2's
  ``Conv1D`` ``c_attn`` stored ``(in, out)``, GPTBigCode's multi-query ``c_attn``; a
  cross-attention layer's queries from ``q_attn``) or `StridedRows` (q, k and v interleaved per
  head: GPT-NeoX's ``query_key_value``, GPTBigCode's multi-head ``c_attn``; per partition:
  CodeGen's ``qkv_proj``). Rows that do not fit the weight are refused.
* peft adapters (`muonclip.integrations.hf_adapters`): a DoRA projection's rows are its
  magnitude vector, a ``modules_to_save`` projection's its trainable copy, a plain LoRA
  projection's its frozen base weight (which MuonClip refuses to write, saying why).
* A projection clamped after the fact (the table's `muonclip.integrations.families.CLAMPS`:
  DBRX's ``clip_qkv``): ValueError — a rescaled row is clamped again.
* Multi-head latent attention (DeepSeek-V3's ``kv_b_proj``): `MLALayout` on ``q_b_proj`` (or
  ``q_proj`` without a query LoRA) and ``kv_b_proj``; the shared rotary key and V are never
  touched.
* A normalisation of q/k after the projection (QK-norm of Qwen3, Gemma 3, OLMo 2; Llama 4's L2
  ``qk_norm``; Phi's ``qk_layernorm``; ...): ValueError naming it — scaling W_q/W_k does not
  change normalised q/k (`muonclip.qkclip.qknorm`). Norms the table states to sit elsewhere are
  allowed: the latent norms of multi-head latent attention feed the scaled projections, the norms
  of `muonclip.integrations.families.OUTPUT_NORMS` act on the attention's output (DiffLlama's
  ``groupnorm``, BitNet's ``attn_sub_norm``), and the modules of
  `muonclip.integrations.families.SELECTION_CHILDREN` only pick keys (the indexer of DeepSeek
  sparse attention).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from functools import cache
from typing import Any

from torch import Tensor, nn

from ..common.families import families
from ..common.family_readers import (
    QKVRows,
    fused_qkv,
    heads_of,
    lacks,
    latent_attention,
    query_heads,
    separate_projections,
    stored_transposed,
)
from ..qkclip._layouts import GQALayout, Layout, MHALayout, MLALayout
from ..qkclip._rows import Rows, StridedRows
from ..qkclip.qknorm import check_no_qk_norm
from .families import CLAMPS, OUTPUT_NORMS, SELECTION_CHILDREN
from .hf_adapters import projection_rows, unwrap


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


_LAYER_IDX = frozenset({"layer_idx"})


def _indexed(named: Iterable[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The modules with a ``layer_idx`` (attention layers and other token mixers) of ``named``."""
    return [(n, m) for n, m in named if not lacks(m, _LAYER_IDX) and hasattr(m, "layer_idx")]


def attention_modules(model: nn.Module, *,
                      named: Sequence[tuple[str, nn.Module]] | None = None) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every softmax-attention module of ``model`` (`dispatches_attention`,
    with a ``layer_idx``), in module order (``named``: ``model.named_modules()``, when the caller has it)."""
    return [(n, m) for n, m in _indexed(model.named_modules() if named is None else named) if dispatches_attention(m)]


def mixers_without_attention(model: nn.Module, attention: list[str], *,
                             named: Sequence[tuple[str, nn.Module]] | None = None) -> list[tuple[str, str]]:
    """``(name, class name)`` of the token mixers with no softmax attention: modules with a
    ``layer_idx`` that are not attention modules (``attention``: their names), contain none and sit
    in none, and contain no other such module (the innermost one is listed) (``named``:
    ``model.named_modules()``, when the caller has it)."""
    skip = set(attention)
    indexed = [n for n, _ in _indexed(model.named_modules() if named is None else named) if n not in skip]

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


def _heads(name: str, module: nn.Module, config: Any) -> tuple[int, int, int]:
    """``(query heads, key heads, head dim)`` of attention module ``name``
    (`muonclip.common.family_readers.heads_of`)."""
    heads = heads_of(module, config)
    if heads is None:
        spec = families().heads
        raise ValueError(
            f"attention layer '{name}' ({type(module).__name__}): its head counts are not stated (module attributes "
            f"{spec.heads.module + spec.head_dim.module}, config keys {spec.heads.config + spec.head_dim.config}), so "
            "no head layout muonclip knows applies. State the layout yourself: "
            "MuonClip(model, layers=[AttentionLayer(name, GQALayout(...), recorder)])"
        )
    return heads.n_heads, heads.n_kv_heads, heads.head_dim


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
    latent = latent_attention(module)
    children = dict(module.named_children())
    q_name = next((a for a in latent.q_up if a in children), None)
    found = [query_heads(module, config)] + [r.read(module, config) for r in (latent.nope, latent.rope, latent.v)]
    if q_name is None:  # the queries come from a projection of another layout (e.g. fused with a gate)
        raise _no_layout(name, module)
    if None in found:
        raise ValueError(
            f"attention layer '{name}' ({type(module).__name__}): its latent attention's head counts or sizes are not "
            f"stated (query heads, {latent.nope}, {latent.rope}, {latent.v}), so no head layout muonclip knows "
            "applies. State the layout yourself: MuonClip(model, layers=[AttentionLayer(name, MLALayout(...), "
            "recorder)])"
        )
    n_heads, nope, rope, v = (f[0] for f in found)
    q_w, q_b = projection_rows(_linear(module, q_name, name), name, q_name)
    kv_w, kv_b = projection_rows(_linear(module, latent.kv_up, name), name, latent.kv_up)
    return MLALayout(q_weight=q_w, n_heads=n_heads, qk_nope_head_dim=nope, qk_rope_head_dim=rope, kv_b_weight=kv_w,
                     v_head_dim=v, q_bias=q_b, kv_b_bias=kv_b)


def _fused_layout(name: str, module: nn.Module, rows: QKVRows, gqa_policy: str) -> MHALayout | GQALayout:
    """A fused projection's rows of q and k, as `rows` states them (`muonclip.param_groups` splits
    the weight into the same maps)."""
    attr = rows.fused.attr
    f = _linear(module, attr, name)
    transposed = stored_transposed(f)
    problem = rows.error(f.weight.shape[1] if transposed else f.weight.shape[0])
    if problem is not None:
        raise ValueError(
            f"attention layer '{name}' ({type(module).__name__}): its fused projection '{attr}' "
            f"{problem}, so no head layout muonclip knows applies. State it yourself: "
            "MuonClip(model, layers=[AttentionLayer(name, GQALayout(Rows(...), Rows(...), ...), recorder)]) with "
            "muonclip.qkclip.Rows / StridedRows"
        )
    n_heads, n_kv, d = rows.heads.n_heads, rows.heads.n_kv_heads, rows.heads.head_dim

    def part(which: str) -> tuple[Rows | StridedRows, Rows | StridedRows | None]:
        if which in rows.fused.order:
            lin, t, (start, block, stride, count) = f, transposed, rows.rows(which)
        else:  # a cross-attention's queries, from their own projection
            lin = _linear(module, rows.fused.query, name)
            t, (start, block, stride, count) = stored_transposed(lin), (0, n_heads * d, n_heads * d, 1)

        def of(x: Tensor | None, tr: bool) -> Rows | StridedRows | None:
            if x is None:
                return None
            if count == 1:
                return Rows(x, start, start + block, transposed=tr)
            return StridedRows(x, start, block, stride, count, transposed=tr)

        return of(lin.weight, t), of(lin.bias, False)

    (q_w, q_b), (k_w, k_b) = part("q"), part("k")
    return _make_layout(q_w, k_w, q_b, k_b, n_heads, n_kv, d, gqa_policy)


def layout_of(name: str, module: nn.Module, config: Any, gqa_policy: str = "per_head") -> Layout:
    """The head layout of attention module ``name`` (module docstring).

    Raises:
        ValueError: a q/k normalisation after the projections (naming it), a clamp of q/k, or no
            projections whose layout is known (naming the module's children).
    """
    children = dict(module.named_children())
    latent = latent_attention(module)
    cls = type(module).__name__
    harmless = [children[a] for a in latent.input_norms if a in children] if latent is not None else []
    harmless += [children[a] for a in OUTPUT_NORMS.get(cls, ()) if a in children]
    harmless += [m for a in SELECTION_CHILDREN if a in children for m in children[a].modules()]
    check_no_qk_norm(name, module, harmless)
    for attr in CLAMPS:
        clamp = getattr(module, attr, None)
        if clamp is not None:
            raise ValueError(
                f"attention layer '{name}' ({cls}) clamps q, k and v to [-{clamp}, {clamp}] after the projection "
                f"({attr}): a rescaled row is clamped again, so QK-Clip's factor would not reach the logits exactly. "
                f"Train it with plain muonclip.Muon, or use a config without {attr}."
            )
    if latent is not None:
        return _mla_layout(name, module, config)
    rows = fused_qkv(module, config)
    if rows is not None:
        return _fused_layout(name, module, rows, gqa_policy)
    names = separate_projections(module)
    if names is not None:
        q_w, q_b = projection_rows(_linear(module, names.q, name), name, names.q)
        k_w, k_b = projection_rows(_linear(module, names.k, name), name, names.k)
        n_heads, n_kv, head_dim = _heads(name, module, config)
        return _make_layout(q_w, k_w, q_b, k_b, n_heads, n_kv, head_dim, gqa_policy)
    fused = [a for a in families().fused_names if a in children]
    if fused:
        raise ValueError(
            f"attention layer '{name}' ({cls}) has a fused projection '{fused[0]}' whose row order (which rows are "
            "each head's q and k) muonclip has not verified for this class, so no head layout muonclip knows "
            "applies. State it yourself: MuonClip(model, layers=[AttentionLayer(name, GQALayout(Rows(...), "
            "Rows(...), ...), recorder)]) with muonclip.qkclip.Rows / StridedRows"
        )
    raise _no_layout(name, module)


__all__ = ["attention_modules", "dispatches_attention", "layout_of", "mixers_without_attention"]
