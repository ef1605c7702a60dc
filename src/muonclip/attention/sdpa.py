"""`scaled_dot_product_attention`: a drop-in for ``F.scaled_dot_product_attention`` that also
records each query head's max logit into a `MaxLogitRecorder` (docs/design.md, "QK-Clip").

Without a recorder it is exactly ``F.scaled_dot_product_attention``. With one, the output is
still SDPA's (same kernel, same autograd graph) and, on a training forward (``training`` true
and grad mode on: the rule of `muonclip.attention.recording`), the per-head max of
``scale * q.k`` over allowed pairs and over the batch is computed (outside autograd) by
`muonclip.attention.max_logits.chunked_max_logits` (bounded memory; never the full
``(B, H, Tq, Tk)`` scores at once) and folded into the recorder's running max, which the next
QK-Clip consumes. Any other call (evaluation, generation, anything under ``torch.no_grad``)
leaves the recorder alone and computes no max, unless a `MaxLogitMonitor` watching the layer is
active, which then receives it.

On CUDA, ``set_max_logit_backend("flex")`` switches eligible calls (no dropout, no mask or a
boolean mask) to FlexAttention, which returns output and row maxima from one fused kernel.
FlexAttention is compiled with ``dynamic=False``: each new (shape, dtype, mask kind) compiles
once, and past dynamo's ``recompile_limit`` (8 by default) it runs unfused, still correct
(raise ``torch._dynamo.config.recompile_limit`` for many sequence lengths). The output is the
FlexAttention kernel's, equal to SDPA's within kernel round-off, not bit-identical. That path
is opt-in and has not yet run on a GPU in this project (`benchmarks/gpu_check.sh` runs its
test); the default ``"chunked"`` works on every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .max_logits import check_shapes, chunked_max_logits, flex_attention_with_max, flex_available
from .recorder import MaxLogitRecorder
from .recording import recorders_to_feed

BACKENDS = ("chunked", "flex")
_backend = "chunked"


def set_max_logit_backend(name: str) -> None:
    """Choose how recorded max logits are computed: ``"chunked"`` (default) or ``"flex"`` (CUDA only;
    falls back to chunked where FlexAttention is unavailable, the mask is additive, or dropout is on)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"max-logit backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


def get_max_logit_backend() -> str:
    """The current max-logit backend name."""
    return _backend


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    recorder: MaxLogitRecorder | None = None,
    training: bool = True,
) -> Tensor:
    """``F.scaled_dot_product_attention`` that also records per-head max logits.

    Args:
        query: ``(B, Hq, Tq, D)``.
        key: ``(B, Hkv, Tk, D)``.
        value: ``(B, Hkv, Tk, Dv)``.
        attn_mask: None (default), a boolean mask (True = attend) or an additive float mask,
            broadcastable to ``(B, Hq, Tq, Tk)``.
        dropout_p: attention dropout probability (default 0.0); does not affect the max logit.
        is_causal: top-left causal mask (default False).
        scale: softmax scale (default None: ``1 / sqrt(D)``).
        enable_gqa: key/value heads shared by ``Hq // Hkv`` consecutive query heads (default False).
        recorder: the calling layer's `MaxLogitRecorder`, with ``n_heads == Hq`` (default
            None: plain SDPA). On a training forward it receives the max over the batch,
            queries and allowed keys of ``scale * q.k`` per query head (after whatever RoPE the
            caller applied; an additive mask's finite bias is not included; fully masked rows
            contribute ``-inf``).
        training: whether the calling module is in training mode: pass ``self.training``, as
            for ``F.dropout`` (default True). The recorder is fed only when ``training`` is
            true and grad mode is on (``torch.is_grad_enabled()``); see
            `muonclip.attention.recording` for the rule and gradient checkpointing.

    Returns:
        ``(B, Hq, Tq, Dv)``: the same as ``F.scaled_dot_product_attention``.
    """
    if recorder is not None:
        hq, _ = check_shapes(query, key, enable_gqa)
        if len(recorder.heads) != hq:
            raise ValueError(f"recorder records {len(recorder.heads)} heads but query has {hq} heads")
    targets = recorders_to_feed(recorder, training)
    if not targets:  # no recorder, or evaluation / generation with no monitor watching: no max to compute
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa,
        )
    if (
        _backend == "flex"
        and dropout_p == 0.0
        and (attn_mask is None or attn_mask.dtype == torch.bool)
        and flex_available(query)
    ):
        out, per_head = flex_attention_with_max(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    else:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa,
        )
        per_head = chunked_max_logits(query, key, attn_mask, is_causal, scale, enable_gqa)
    for target in targets:
        target.update(per_head)
    return out


__all__ = ["BACKENDS", "get_max_logit_backend", "scaled_dot_product_attention", "set_max_logit_backend"]
