"""Max logits of a call over packed documents (a varlen kernel), one document at a time.

A call with ``cu_seq_lens`` (`muonclip.attention.call.AttentionCall`: one packed row of ``T``
tokens, ``N`` documents) sees only pairs within a document (rule 4 of
`muonclip.attention.pairs`). Its exact per-head max is the max over documents of each
document's own max, each document being an ordinary call on its slice of q and k (the causal
rule within it): `document_max_logits` computes it so, never the ``(T, T)`` mask of the rule's
definition, with `muonclip.attention.chunked_max_logits` (on a CUDA GPU with Triton,
`muonclip.attention._triton_max_logits`) per document.

The LSE gate (`muonclip.attention._gate`) takes `document_max_logits` of the heads whose bound
passes the threshold.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _triton_max_logits as triton_max
from ._max_logits import chunked_max_logits
from .call import AttentionCall


def _slice(t: Tensor | None, a: int, b: int) -> Tensor | None:
    return None if t is None else t[:, a:b]


@torch.no_grad()
def document_max_logits(call: AttentionCall, heads: Tensor | None = None) -> Tensor:
    """Exact max logit of every query head (or of ``heads``) over the pairs of the call's documents.

    Args:
        call: an `AttentionCall` with ``cu_seq_lens``.
        heads: 1-D index tensor of query heads (default None: all ``Hq``).

    Returns:
        ``(Hq,)`` (or ``(len(heads),)``) float32; ``-inf`` for a head with no pair (no document
        holds a token).
    """
    q, k = call.query, call.key
    hq, hkv = call.heads()
    gqa = call.enable_gqa
    if heads is not None:
        q, k, gqa = q.index_select(1, heads), k.index_select(1, heads // (hq // hkv)), False
    out = torch.full((q.shape[1],), -math.inf, device=q.device)
    for a, b in call.documents():
        a, b = max(a, 0), min(b, q.shape[2])
        if b <= a:
            continue
        qd, kd = q[:, :, a:b], k[:, :, a:b]
        rq, rk = _slice(call.real_queries, a, b), _slice(call.real_keys, a, b)
        if rq is None and rk is None and triton_max.usable(qd, kd, call.scale):
            m = triton_max.triton_max_logits(qd, kd, None, call.is_causal, call.scale, gqa)
        else:
            sub = AttentionCall(qd, kd, kd, is_causal=call.is_causal, scale=call.scale, enable_gqa=gqa,
                                real_queries=rq, real_keys=rk)
            mask, causal = sub.clip_pairs()
            m = chunked_max_logits(qd, kd, mask, causal, call.scale, gqa)
        out = torch.maximum(out, m.to(out.device))
    return out


__all__ = ["document_max_logits"]
