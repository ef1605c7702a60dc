"""Gemma 2's soft-capped attention for the reference GPT (``attn_softcap = c > 0``): the softmax
over ``c * tanh(s / c)`` of every logit ``s``, computed eagerly, its recorder fed the raw logits'
row maxima (`softcap_attention`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention import MaxLogitRecorder
from ..attention.call import AttentionCall
from ..attention.record import Kernel, attend


class _SoftcapKernel(Kernel):
    """Causal attention over soft-capped logits, eager; its row maxima are those of the raw
    logits, taken from the scores it materialises anyway (``row_max_only``)."""

    row_max_only = True

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def _scores(self, call: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = call.query, call.key, call.value
        hq, hkv = q.shape[1], k.shape[1]
        if hkv != hq:
            k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
        s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if call.scale is None else call.scale)  # (B, H, T, T)
        T = q.shape[2]
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        return s.masked_fill(future, -math.inf), v, future

    def _output(self, call: AttentionCall, s: Tensor, v: Tensor, future: Tensor) -> Tensor:
        weights = torch.softmax((self.cap * torch.tanh(s / self.cap)).masked_fill(future, -math.inf), dim=-1)
        if call.dropout_p:
            weights = F.dropout(weights, call.dropout_p)
        return weights @ v

    def run(self, call: AttentionCall, lse: bool) -> tuple[Tensor, Tensor | None]:
        s, v, future = self._scores(call)
        return self._output(call, s, v, future), None

    def run_with_row_max(self, call: AttentionCall) -> tuple[Tensor, Tensor]:
        s, v, future = self._scores(call)
        return self._output(call, s, v, future), s.detach().amax(dim=-1)


def softcap_attention(q: Tensor, k: Tensor, v: Tensor, cap: float, *, scale: float | None = None,
                      dropout_p: float = 0.0, recorder: MaxLogitRecorder | None = None,
                      training: bool = True) -> Tensor:
    """Causal attention over soft-capped logits (Gemma 2): for query i,
    ``sum_{j <= i} softmax_j(cap * tanh(s_ij / cap)) v_j`` with ``s_ij = scale * q_i . k_j``.

    Computed eagerly (the ``(B, H, T, T)`` scores are materialised). The recorder receives, on
    the calls `muonclip.attention.forward_rule` says feed it (a training forward, or an active
    monitor), each query head's max of the *raw* logits ``s_ij`` over the allowed pairs (the
    kernel's own row maxima, through `muonclip.attention.record.attend`): the capped maximum is
    ``cap * tanh(raw / cap)`` of it (tanh is increasing).

    Args:
        q: ``(B, Hq, T, D)``.
        k: ``(B, Hkv, T, D)``; ``Hkv`` divides ``Hq`` (query head h uses key head ``h // (Hq // Hkv)``).
        v: ``(B, Hkv, T, Dv)``.
        cap: the soft cap ``c`` (> 0).
        scale: logit scale (default None: ``1 / sqrt(D)``).
        dropout_p: dropout on the attention weights (default 0.0).
        recorder: the layer's `MaxLogitRecorder` (default None: nothing recorded).
        training: the calling module's ``training`` (default True).

    Returns:
        ``(B, Hq, T, Dv)``.
    """
    if not cap > 0:
        raise ValueError(f"the soft cap must be > 0, got {cap!r}")
    call = AttentionCall(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return attend(call, recorder, training, _SoftcapKernel(cap))
