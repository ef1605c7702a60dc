"""`scaled_dot_product_attention`: a drop-in for ``F.scaled_dot_product_attention`` that also
records each query head's max logit into a `MaxLogitRecorder` (docs/design.md, "QK-Clip").

Without a recorder it is exactly ``F.scaled_dot_product_attention``. With one, the output is
still SDPA's (same kernel, same autograd graph) and, on a training forward (``training`` true
and grad mode on: the rule of `muonclip.attention.forward_rule`), the per-head max of
``scale * q.k`` over the pairs the clip sees (`muonclip.attention.pairs`: allowed by the mask,
both tokens real) and over the batch is folded into the recorder's running max, which the next
QK-Clip consumes. Any other call (evaluation, generation, anything under ``torch.no_grad``)
leaves the recorder alone and computes no max, unless a `MaxLogitMonitor` watching the layer is
active, which then receives it.

The call goes through the one recording path, `muonclip.attention.record.attend`, which also
chooses how the max is computed (`set_max_logit_backend`: ``"gated"``, the default, the LSE gate
at the recorders' threshold; ``"chunked"``, always exact; ``"flex"``, FlexAttention's in-kernel
max on CUDA; see `muonclip.attention.record`).
"""

from __future__ import annotations

from torch import Tensor

from ._recorder import MaxLogitRecorder
from .call import AttentionCall
from .record import attend


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
    sinks: Tensor | None = None,
    recorder: MaxLogitRecorder | None = None,
    training: bool = True,
    real_queries: Tensor | None = None,
    real_keys: Tensor | None = None,
) -> Tensor:
    """``F.scaled_dot_product_attention`` that also records per-head max logits.

    Args:
        query: ``(B, Hq, Tq, D)``.
        key: ``(B, Hkv, Tk, D)``.
        value: ``(B, Hkv, Tk, Dv)``.
        attn_mask: None (default), a boolean mask (True = attend) or an additive float mask,
            broadcastable to ``(B, Hq, Tq, Tk)``. For the recorded max, an additive entry at or
            below ``-1e4`` masks its pair (``-inf``, ``-1e9``, every ``finfo.min``); one above
            is a bias, not part of the max (`muonclip.attention.pairs`).
        dropout_p: attention dropout probability (default 0.0); does not affect the max logit.
        is_causal: top-left causal mask (default False).
        scale: softmax scale (default None: ``1 / sqrt(D)``).
        enable_gqa: key/value heads shared by ``Hq // Hkv`` consecutive query heads (default False).
        sinks: ``(Hq,)`` learned sink logits, one per query head, that join every row's softmax
            denominator with no value (GPT-OSS's ``sinks``; default None: no sink). Computed by
            `muonclip.attention.sinks.sink_attention` (fused; its gradient reaches ``sinks``).
            The recorded max logit stays the max of ``scale * q.k``: a sink is not a product of
            the query and key projections.
        recorder: the calling layer's `MaxLogitRecorder`, with ``n_heads == Hq`` (default
            None: plain SDPA). On a training forward it receives the max over the batch,
            real queries and allowed real keys of ``scale * q.k`` per query head (after
            whatever RoPE the caller applied; an additive mask's finite bias is not included;
            a head with no such pair gets ``-inf``). If the recorder has a ``threshold`` (the
            clip's tau), heads that provably stay at or below it may be recorded as an upper
            bound instead (``"gated"`` backend; `MaxLogitRecorder.bounded` says which).
        training: whether the calling module is in training mode: pass ``self.training``, as
            for ``F.dropout`` (default True). The recorder is fed only when ``training`` is
            true and grad mode is on (``torch.is_grad_enabled()``); see
            `muonclip.attention.forward_rule` for the rule and gradient checkpointing.
        real_queries: ``(B, Tq)`` bool, True where the query is a real token, False for padding
            (default None: every query is real). A padding query's pairs are not recorded,
            whatever the mask lets it see (under right padding it sees the real keys before it).
            The output is unchanged.
        real_keys: ``(B, Tk)`` bool, True where the key is a real token (default None: all).
            A padding key's pairs are not recorded, even where the mask lets them through.

    Returns:
        ``(B, Hq, Tq, Dv)``: the same as ``F.scaled_dot_product_attention`` (with ``sinks``: the
        same as transformers' eager sink attention).
    """
    call = AttentionCall(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks=sinks,
                         real_queries=real_queries, real_keys=real_keys)
    return attend(call, recorder, training)
