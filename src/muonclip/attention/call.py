"""`AttentionCall`: one attention call's arguments, the object every recording entry point builds.

The drop-in `muonclip.scaled_dot_product_attention`, the Hugging Face ``"muonclip"`` attention
function, the torchtitan recorders and the reference GPT (through the drop-in) each describe
their call once, as an `AttentionCall`, and hand it to the one recording path
(`muonclip.attention.record.attend`); the kernels, the LSE gate and the exact max read their
arguments from it. Its fields are ``F.scaled_dot_product_attention``'s, plus the learned sinks
and the token masks of the pair rule (`muonclip.attention.pairs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from .pairs import clip_pairs


@dataclass(frozen=True)
class AttentionCall:
    """One attention call.

    Args:
        query: ``(B, Hq, Tq, D)``.
        key: ``(B, Hkv, Tk, D)``.
        value: ``(B, Hkv, Tk, Dv)``.
        attn_mask: None (default), a boolean mask (True = attend) or an additive float mask,
            broadcastable to ``(B, Hq, Tq, Tk)``; an entry ``<= MASKED_AT`` (-1e4) masks
            (`muonclip.attention.pairs`).
        dropout_p: attention dropout probability (default 0.0).
        is_causal: top-left causal rule, ``j <= i`` (default False).
        scale: softmax scale (default None: ``1 / sqrt(D)``).
        enable_gqa: key/value head ``h // (Hq // Hkv)`` serves query head h (default False).
        sinks: ``(Hq,)`` learned sink logits (default None; `muonclip.attention.sinks`).
        real_queries: ``(B, Tq)`` bool, True where the query is a real token (default None:
            all); padding queries' pairs are not seen by the clip.
        real_keys: ``(B, Tk)`` bool, True where the key is a real token (default None: all).
    """

    query: Tensor
    key: Tensor
    value: Tensor
    attn_mask: Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False
    sinks: Tensor | None = None
    real_queries: Tensor | None = None
    real_keys: Tensor | None = None

    @property
    def softmax_scale(self) -> float:
        """``scale``, or ``1 / sqrt(D)`` when it is None."""
        return 1.0 / math.sqrt(self.query.shape[-1]) if self.scale is None else self.scale

    def heads(self) -> tuple[int, int]:
        """``(Hq, Hkv)``, after checking the shapes (`check_shapes`)."""
        return check_shapes(self.query, self.key, self.enable_gqa)

    def clip_pairs(self) -> tuple[Tensor | None, bool]:
        """``(mask, is_causal)`` of the pairs QK-Clip sees (`muonclip.attention.pairs.clip_pairs`)."""
        return clip_pairs(self.attn_mask, self.is_causal, self.query.shape[2], self.key.shape[2],
                          self.real_queries, self.real_keys)

    def sdpa_kwargs(self) -> dict:
        """The keywords of ``F.scaled_dot_product_attention`` for this call (all but q, k, v)."""
        return dict(attn_mask=self.attn_mask, dropout_p=self.dropout_p, is_causal=self.is_causal, scale=self.scale,
                    enable_gqa=self.enable_gqa)


def check_shapes(query: Tensor, key: Tensor, enable_gqa: bool) -> tuple[int, int]:
    """Validate ``query (B, Hq, Tq, D)`` / ``key (B, Hkv, Tk, D)``; return ``(Hq, Hkv)``."""
    if query.ndim != 4 or key.ndim != 4:
        raise ValueError(
            f"recording max logits needs 4-D query (B, Hq, Tq, D) and key (B, Hkv, Tk, D), got "
            f"{tuple(query.shape)} and {tuple(key.shape)}"
        )
    hq, hkv = query.shape[1], key.shape[1]
    if hq != hkv and not (enable_gqa and hq % hkv == 0):
        raise ValueError(
            f"query has {hq} heads and key {hkv}; pass enable_gqa=True with Hq a multiple of Hkv for GQA/MQA"
        )
    return hq, hkv


__all__ = ["AttentionCall", "check_shapes"]
