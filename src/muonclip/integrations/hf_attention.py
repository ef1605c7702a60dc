"""The ``"muonclip"`` attention function for transformers: SDPA semantics, max logits recorded, nothing else.

Every attention module of a transformers 5.x model calls
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value,
attention_mask, dropout=..., scaling=..., **kwargs)`` with the queries after RoPE and the keys
before GQA repetition. `muonclip_attention_forward` computes what the model's own attention
computes, through `muonclip.scaled_dot_product_attention`, which also folds the call's per-head
max logit into the recorder `muonclip.integrations.hf.attach` put on the module.

**Keywords: an allow-list.** A keyword the function does not know could carry a feature it
would silently drop (a learned sink, a bias, a sparse key selection), so it accepts only the
keywords listed in `KEYWORDS`, each with how it is honoured, and refuses any other with a
ValueError naming the keyword and the layer. Some keywords name features it does not compute
and are accepted only when they are off (`OFF_ONLY`: ``softcap=None``, ``position_bias=None``,
``output_attentions`` false, ...). A new transformers release that passes a new keyword stops
at the first forward instead of changing the model (or, where its class passes it explicitly,
at ``attach``: below).

**Keywords visible before any forward.** The keywords a module's class passes explicitly to
its attention function are read from its source when the model is attached
(`check_module_keywords`): one the function does not implement, or an `OFF_ONLY` feature that is
on in the module's configuration (Gemma 2's ``softcap=self.attn_logit_softcapping``; a sparse
``indices`` selection from an ``indexer`` child), is refused by ``attach`` / ``MuonClip(model)``
itself, before the model is switched.

**Padding queries** (the pair rule of `muonclip.attention.pairs`). transformers' mask already
keeps every query away from padding keys (and, for a packed row, from other documents), but not
padding *queries*: under right padding a pad query sees the real keys before it. The function
tells the call which queries are real (`real_queries`: from the mask itself, and in
padding-free packing from the real-token mask `attach`'s forward pre-hook passes down as the
keyword `TOKENS_KWARG`); their pairs are not recorded; the output is unchanged.

`register` registers the function, and the SDPA boolean mask (``sdpa_mask``) as its mask
function under the same name with ``AttentionMaskInterface``: without a registered mask
function transformers builds *no mask at all* for an unknown implementation name, and padded
batches would attend to padding.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from functools import cache
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..attention.call import AttentionCall
from ..attention.pairs import allowed_pairs
from ..attention.record import attend as record_attend
from .families import SELECTION_CHILDREN

ATTN_IMPLEMENTATION = "muonclip"
"""The name our attention function and mask are registered under."""

RECORDER_ATTR = "muonclip_recorder"
"""Attribute of an attention module holding its `muonclip.attention.MaxLogitRecorder`."""

LAYER_ATTR = "muonclip_layer"
"""Attribute of an attention module holding its layer name (``"model.layers.0.self_attn"``), for messages."""

CHECK_ATTR = "muonclip_forward_check"
"""Attribute of an attention module holding its pending `muonclip.integrations.hf_check.ForwardCheck`."""

TOKENS_KWARG = "muonclip_real_tokens"
"""Keyword under which `attach`'s forward pre-hook passes the batch's real-token mask ``(B, T)``
down to the attention function (`muonclip.integrations.hf.real_tokens`)."""

TEXT_ATTR = "muonclip_text_layer"
"""Attribute of an attention module: True when it is a self-attention over the model's tokens
(its text stack, not a cross-attention), so its queries' padding can be read off its mask and
`TOKENS_KWARG` (`real_queries`); a vision tower's or a cross-attention's layers never read it."""

_MODEL_LEVEL = (
    "a model-level argument passed down through the attention module's **kwargs; it does not enter attention"
)
_PACKING = (
    "flash-attention's description of packed documents; the documents are in the mask transformers builds "
    "from position_ids (attach makes the model build it for a packed batch: muonclip.integrations.hf)"
)

KEYWORDS: dict[str, str] = {
    "dropout": "attention dropout probability, as SDPA's dropout_p",
    "scaling": "the softmax scale, as SDPA's scale",
    "is_causal": "the causal rule when no mask is given, as transformers' sdpa_attention_forward",
    "s_aux": "learned attention sinks, one logit per query head in the softmax denominator "
             "(muonclip.attention.sinks)",
    "sliding_window": "the window is already in the mask transformers builds for the layer (the registered mask "
                      "function is sdpa_mask); this copy of it is for flash-attention kernels",
    "position_ids": "positions are applied (RoPE) before the call; packed documents are in the mask",
    "cu_seq_lens_q": _PACKING,
    "cu_seq_lens_k": _PACKING,
    "max_length_q": _PACKING,
    "max_length_k": _PACKING,
    "seq_idx": _PACKING,
    "use_cache": _MODEL_LEVEL,
    "output_hidden_states": _MODEL_LEVEL,
    "output_router_logits": _MODEL_LEVEL,
    "num_items_in_batch": _MODEL_LEVEL,
    "return_dict": _MODEL_LEVEL,
    "labels": _MODEL_LEVEL,
    "logits_to_keep": _MODEL_LEVEL,
    "encoder_hidden_states": "a cross-attention module computes its keys and values from it before the call; "
                             "the copy passed down does not enter attention",
    TOKENS_KWARG: "the real tokens of a padding-free packed batch (attach's forward pre-hook): padding queries' "
                  "pairs are not recorded",
}
"""Every keyword the function accepts (besides those of `OFF_ONLY`), and how it is honoured."""

OFF_ONLY: dict[str, str] = {
    "softcap": "logit soft-capping hides the raw logits QK-Clip bounds; use a config without "
               "attn_logit_softcapping",
    "position_bias": "an additive learned position bias is not a product of W_q and W_k, so clipping them cannot "
                     "bound the logits; QK-Clip serves RoPE-style models",
    "output_attentions": "the function returns no attention weights; use attn_implementation='eager' for them",
    "cache": "paged caches (continuous batching) are not supported; for generation switch back with "
             "muonclip.integrations.hf.detach(model)",
    "indices": "a sparse top-k key selection (an indexer's, for flash kernels) is not computed: muonclip's "
               "attention is dense",
    "block_indices": "a sparse block selection is not computed: muonclip's attention is dense",
    "sinks": "attention sinks passed as `sinks` rather than transformers' `s_aux` are not computed",
}
"""Keywords accepted only when off (None or False), with why the feature is not computed."""


def layer_name(module: nn.Module) -> str:
    """The attached layer's name (set by `attach`), else its class and ``layer_idx``."""
    name = getattr(module, LAYER_ATTR, None)
    return name or f"{type(module).__name__}(layer_idx={getattr(module, 'layer_idx', None)})"


def check_keywords(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """Raise ValueError naming the keyword and the layer for every keyword not in `KEYWORDS`, or in
    `OFF_ONLY` but switched on."""
    for key, value in kwargs.items():
        if key in KEYWORDS:
            continue
        if key in OFF_ONLY:
            if value is None or value is False:
                continue
            raise ValueError(_off_only_message(module, key))
        raise ValueError(_not_implemented_message(module, key, type(value).__name__))


def _off_only_message(module: nn.Module, key: str, name: str | None = None) -> str:
    return (f"attention layer '{name or layer_name(module)}' ({type(module).__name__}) passes `{key}`, which the "
            f"'{ATTN_IMPLEMENTATION}' attention function does not compute: {OFF_ONLY[key]}")


def _not_implemented_message(module: nn.Module, key: str, what: str, name: str | None = None) -> str:
    return (
        f"attention layer '{name or layer_name(module)}' ({type(module).__name__}) passes `{key}` ({what}) to its "
        f"attention function, a keyword the '{ATTN_IMPLEMENTATION}' attention function does not implement, so it "
        f"would silently change what the model computes. Implemented: {', '.join(sorted(KEYWORDS))}. Train this "
        "model with plain muonclip.Muon, or state its layers yourself with MuonClip(model, layers=[...]) and an "
        "attention that records max logits."
    )


def muonclip_attention_forward(
    module: nn.Module,
    query: Tensor,  # (B, nh, Tq, hs) after RoPE
    key: Tensor,  # (B, nkv, Tk, hs) before GQA repetition
    value: Tensor,  # (B, nkv, Tk, hv)
    attention_mask: Tensor | None,  # (B, 1, Tq, Tk) bool (True = attend) or additive float, or None
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function: the model's attention, recording per-head max logits.

    Semantics of transformers' ``sdpa_attention_forward``, plus attention sinks: ``is_causal``
    (default: the module's ``is_causal``, else True) is used only when there is no mask and more
    than one query, and then keys are cropped to the query length (prefill into an empty static
    cache); GQA by ``enable_gqa`` without a mask, by repeating key/value heads with one; with
    ``s_aux`` the sink logits join every row's softmax denominator, as in the eager attention of
    GPT-OSS and every sink model. The output is ``(B, Tq, nh, hv)`` and no attention weights.

    Args:
        module: the calling attention module; its ``muonclip_recorder`` (set by `attach`)
            receives, on a training forward (``module.training`` and grad enabled), the
            per-head max of ``scaling * q.k`` over the pairs the mask allows (never a sink: it
            is not a product of W_q and W_k). A module without one is computed without recording.
            With `MuonClip` (which sets the recorders' threshold to its tau), heads that provably
            stay at or below tau may be recorded as an upper bound from the kernel's log-sum-exp
            instead (`muonclip.attention._gate`): the clip's decisions and gammas are those of the
            exact maxima. A module with a pending ``muonclip_forward_check`` (set by `attach`)
            also runs its check on its first training forward
            (`muonclip.integrations.hf_check`).
        query: ``(B, nh, Tq, hs)``, after RoPE.
        key: ``(B, nkv, Tk, hs)``, before GQA repetition.
        value: ``(B, nkv, Tk, hv)``.
        attention_mask: the mask built by the registered mask function (or passed by the user).
        dropout: attention dropout probability (0.0 default; transformers passes 0 in eval).
        scaling: softmax scale (None: 1/sqrt(hs)).
        is_causal: see above (None default).
        **kwargs: the keywords of `KEYWORDS` (``s_aux``, ``sliding_window``, ``position_ids``,
            `TOKENS_KWARG`, ...), and those of `OFF_ONLY` when off; any other raises ValueError
            (`check_keywords`).
    """
    check_keywords(module, kwargs)
    out = attend(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs.get("s_aux"),
                 getattr(module, RECORDER_ATTR, None), real_queries(module, kwargs.get(TOKENS_KWARG), attention_mask,
                                                                    query, key))
    check = getattr(module, CHECK_ATTR, None)
    if check is not None and check.pending:
        out = check.run(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs, out)
    return out.contiguous(), None


def real_queries(module: nn.Module, tokens: Tensor | None, attention_mask: Tensor | None, query: Tensor,
                 key: Tensor) -> Tensor | None:
    """``(B, Tq)`` bool, which of the call's queries are real tokens, or None (all real).

    For a self-attention layer over the model's tokens (`TEXT_ATTR`; the queries are the last
    ``Tq`` of the ``Tk`` keys, after any cached ones):

    * the 2-D attention mask, as the call's mask holds it: transformers builds it so that no query
      sees a padding key, and every other rule it writes (causal, sliding window, chunks, packed
      documents) lets a token see itself, so a query is padding exactly when its own key is
      masked (the mask's diagonal at offset ``Tk - Tq``, under the pair rule's
      `muonclip.attention.pairs.allowed_pairs`);
    * in padding-free packing, ``tokens``: the real-token mask ``(B, Tk)`` `attach`'s forward
      pre-hook passes down (`TOKENS_KWARG`, `muonclip.integrations.hf.real_tokens`).

    None where the call has no mask (transformers found no padding and no packed documents), or
    the module is not such a layer.
    """
    if attention_mask is None or not getattr(module, TEXT_ATTR, False):
        return None
    b, tq, tk = query.shape[0], query.shape[2], key.shape[2]
    if tq > tk:
        return None
    mask = attention_mask.reshape((1,) * (4 - attention_mask.ndim) + tuple(attention_mask.shape))
    if mask.shape[-2:] != (tq, tk):
        return None
    own = allowed_pairs(torch.diagonal(mask, offset=tk - tq, dim1=-2, dim2=-1))  # (B or 1, H or 1, Tq)
    real = own.any(dim=1).expand(b, tq)
    if tokens is not None and tokens.ndim == 2 and tokens.shape == (b, tk):
        real = real & tokens[:, tk - tq:]
    return real


def attend(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float,
    scaling: float | None,
    is_causal: bool | None,
    sinks: Tensor | None,
    recorder: Any,
    real_queries: Tensor | None = None,
) -> Tensor:
    """The computation of `muonclip_attention_forward` (its arguments; ``sinks`` is ``s_aux``,
    ``recorder`` the module's recorder or None, ``real_queries`` the call's real queries): the
    call as an `AttentionCall` through the recording path (`muonclip.attention.record.attend`);
    returns ``(B, Tq, nh, hv)``, not contiguous."""
    n_heads, q_len = query.shape[1], query.shape[2]
    enable_gqa = False
    if key.shape[1] != n_heads:
        if n_heads % key.shape[1]:
            raise ValueError(f"attention layer '{layer_name(module)}': {n_heads} query heads cannot share "
                             f"{key.shape[1]} key heads (not a divisor)")
        if attention_mask is None:
            enable_gqa = True
        else:
            rep = n_heads // key.shape[1]
            key = key.repeat_interleave(rep, dim=1)  # (B, nh, Tk, hs)
            value = value.repeat_interleave(rep, dim=1)  # (B, nh, Tk, hv)

    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(q_len > 1 and attention_mask is None and is_causal)
    if is_causal and key.shape[2] > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]

    call = AttentionCall(query, key, value, attention_mask, dropout, is_causal, scaling, enable_gqa, sinks=sinks,
                         real_queries=real_queries)
    return record_attend(call, recorder, module.training).transpose(1, 2)  # (B, Tq, nh, hv)


# ----------------------------------------------------------------------------------------------
# keywords visible before any forward
# ----------------------------------------------------------------------------------------------

@cache
def _class_keywords(cls: type) -> tuple[tuple[str, str | None], ...]:
    """``(keyword, value)`` of every keyword a class (or a base) passes explicitly to its attention
    function (``attention_interface(...)``, the name every transformers family binds it to), read
    from the source: ``value`` is the dotted attribute path (``"self.attn_logit_softcapping"``) or
    the literal (``"None"``) it passes, None for anything else (known only at the forward)."""
    found: list[tuple[str, str | None]] = []
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "attention_interface"):
                continue
            for kw in node.keywords:
                if kw.arg is None:
                    continue
                value = kw.value
                text = ast.unparse(value)
                static = isinstance(value, ast.Constant) or (
                    isinstance(value, ast.Attribute) and text.startswith("self.")
                    and all(part.isidentifier() for part in text.split(".")))
                found.append((kw.arg, text if static else None))
        if found:
            return tuple(found)
    return tuple(found)


def _static_value(module: nn.Module, text: str) -> tuple[bool, Any]:
    """``(known, value)`` of a keyword's source text on ``module``: a literal, or a ``self.a.b``
    attribute path (unknown when an attribute is missing)."""
    if not text.startswith("self."):
        return True, ast.literal_eval(text)
    obj: Any = module
    for part in text.split(".")[1:]:
        if not hasattr(obj, part):
            return False, None
        obj = getattr(obj, part)
    return True, obj


def check_module_keywords(module: nn.Module, name: str | None = None) -> None:
    """Refuse, before any forward, what the first forward of ``module`` would refuse in
    `check_keywords`: a keyword its class passes explicitly to the attention function that the
    function does not implement, or an `OFF_ONLY` feature on in the module's configuration (its
    value read from the module: ``softcap=self.attn_logit_softcapping``), or a sparse key
    selection from an ``indexer`` child (``indices``: DeepSeek sparse attention hands its top-k to
    any attention function but eager and SDPA; `muonclip.integrations.families.SELECTION_CHILDREN`).
    ``name`` is the layer's name for the message (default: `layer_name`).

    Raises:
        ValueError: with `check_keywords`' message.
    """
    for key, text in _class_keywords(type(module)):
        if key in KEYWORDS or key in ("query", "key", "value", "attention_mask"):
            continue
        if key not in OFF_ONLY:
            raise ValueError(_not_implemented_message(module, key, text or "computed in its forward", name))
        known, value = (False, None) if text is None else _static_value(module, text)
        selects = key in ("indices", "block_indices") and any(
            isinstance(getattr(module, child, None), nn.Module) for child in SELECTION_CHILDREN)
        if (known and value is not None and value is not False) or (not known and selects):
            raise ValueError(_off_only_message(module, key, name))


def register() -> None:
    """Register the ``"muonclip"`` attention function and its SDPA mask with transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, muonclip_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


__all__ = [
    "ATTN_IMPLEMENTATION", "CHECK_ATTR", "KEYWORDS", "LAYER_ATTR", "OFF_ONLY", "RECORDER_ATTR", "TEXT_ATTR",
    "TOKENS_KWARG", "attend", "check_keywords", "check_module_keywords", "layer_name",
    "muonclip_attention_forward", "real_queries", "register",
]
