"""`AttentionCall`: one attention call's arguments, the object every recording entry point builds.

The drop-in `muonclip.scaled_dot_product_attention`, the Hugging Face ``"muonclip"`` attention
function, the torchtitan recorders and the reference GPT (through the drop-in) each describe
their call once, as an `AttentionCall`, and hand it to the one recording path
(`muonclip.attention.record.attend`); the kernels, the LSE gate and the exact max read their
arguments from it. Its fields are ``F.scaled_dot_product_attention``'s, plus the learned sinks,
the token masks and the document boundaries of the pair rule (`muonclip.attention.pairs`).

**Packed documents** (``cu_seq_lens``: a varlen kernel such as torch's
``torch.nn.attention.varlen.varlen_attn``): the batch is one packed row (``B == 1``) of
``T`` tokens, ``cu_seq_lens`` ``(N + 1,)`` the offsets of its ``N`` documents (document ``d``
is tokens ``cu_seq_lens[d]`` to ``cu_seq_lens[d + 1] - 1``), the same for queries and keys
(self-attention); a query sees only keys of its own document (and, with ``is_causal``, not
after itself). Such a call has no ``attn_mask`` and no sinks.
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
        cu_seq_lens: ``(N + 1,)`` integer offsets of the packed documents (default None: no
            documents; see the module docstring).
        cu_seq_lens_host: the same offsets as a tuple of ints, when the caller has them on the
            host (default None: read from ``cu_seq_lens`` when needed, one host sync on a GPU).

    Raises:
        ValueError: documents with a batch of more than one row, an ``attn_mask`` or sinks, or
            ``cu_seq_lens`` not a 1-D integer tensor of at least 2 entries.
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
    cu_seq_lens: Tensor | None = None
    cu_seq_lens_host: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.cu_seq_lens is None:
            return
        c = self.cu_seq_lens
        if c.ndim != 1 or c.numel() < 2 or c.is_floating_point() or c.is_complex():
            raise ValueError(f"cu_seq_lens must be a 1-D integer tensor of N + 1 >= 2 document offsets, got shape "
                             f"{tuple(c.shape)} of {c.dtype}")
        if self.query.shape[0] != 1 or self.key.shape[0] != 1:
            raise ValueError(f"packed documents (cu_seq_lens) take one packed row: query and key of batch 1, got "
                             f"{self.query.shape[0]} and {self.key.shape[0]}")
        if self.attn_mask is not None or self.sinks is not None:
            raise ValueError("packed documents (cu_seq_lens) take no attn_mask and no sinks: the documents and the "
                             "causal rule are the call's pairs")

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
                          self.real_queries, self.real_keys, self.cu_seq_lens)

    def documents(self) -> list[tuple[int, int]]:
        """``[(start, stop), ...]``: the token range of every document (``cu_seq_lens``), on the
        host (from ``cu_seq_lens_host`` when given); ``[]`` without documents."""
        if self.cu_seq_lens is None:
            return []
        cu = self.cu_seq_lens_host if self.cu_seq_lens_host is not None else tuple(self.cu_seq_lens.tolist())
        return list(zip(cu[:-1], cu[1:]))

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
