"""Which (query, key) pairs QK-Clip sees: the one definition (docs/design.md, "QK-Clip").

**The rule.** A pair ``(i, j)`` of an attention call counts towards its head's max logit if and
only if

1. the model's attention lets query ``i`` see key ``j``: the causal rule (``is_causal``), a
   boolean mask entry that is True, or an additive float mask entry above `MASKED_AT`
   (sliding windows, documents of a packed row and padded keys are in the mask the model
   builds);
2. query ``i`` is a real token (``real_queries``: a padding query attends to the real keys
   before it under right padding, but its logits never reach a real token's output); and
3. key ``j`` is a real token (``real_keys``); and
4. with packed documents (``cu_seq_lens``: a varlen kernel), query ``i`` and key ``j`` are in
   the same document (a token outside every document, before the first offset or from the
   last one on, is in none: none of its pairs counts).

Where padding comes from is each entry point's business (the Hugging Face attention function:
the 2-D attention mask, or in padding-free packing the pad token id,
`muonclip.integrations.hf`); what it means is decided here.

**Float masks: a threshold, not ``finfo.min``.** An additive mask entry at or below
``MASKED_AT = -1e4`` is a mask: ``exp(s - 1e4)`` is 0 in every float format (float64's smallest
number is ``exp(-745)``) for any logit ``s`` below about 9000, so such a pair gets zero weight
whatever the mask's dtype: ``-inf``, ``-1e9`` and every ``finfo(dtype).min`` (float16's is
``-65504``) all mask. An entry above it is a bias (ALiBi-style): the pair is seen by attention
with that offset, and its q·k logit counts; the bias itself is not part of the max (QK-Clip
cannot scale it).

Nothing here reads a device value: the rule is a few element-wise operations, no host sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

MASKED_AT = -1e4
"""An additive mask entry ``<= MASKED_AT`` masks its pair; above it, it is a bias."""


def allowed_pairs(mask: Tensor) -> Tensor:
    """Boolean "the attention lets this pair through" of an SDPA mask: the mask itself if
    boolean, else ``mask > MASKED_AT`` (module docstring)."""
    if mask.dtype == torch.bool:
        return mask
    return mask > MASKED_AT


def _four_d(t: Tensor) -> Tensor:
    return t.reshape((1,) * (4 - t.ndim) + tuple(t.shape)) if t.ndim < 4 else t


def document_ids(cu_seq_lens: Tensor, n: int) -> Tensor:
    """``(n,)`` int64: the document of each of ``n`` packed tokens under the offsets ``cu_seq_lens``
    ``(N + 1,)``; ``-1`` for a token outside every document (no host sync)."""
    pos = torch.arange(n, device=cu_seq_lens.device)
    cu = cu_seq_lens.to(device=pos.device, dtype=torch.int64)
    doc = torch.bucketize(pos, cu, right=True) - 1
    return doc.masked_fill((doc < 0) | (doc >= cu.numel() - 1), -1)


def clip_pairs(attn_mask: Tensor | None, is_causal: bool, tq: int, tk: int, real_queries: Tensor | None = None,
               real_keys: Tensor | None = None, cu_seq_lens: Tensor | None = None) -> tuple[Tensor | None, bool]:
    """The pairs QK-Clip sees in one call, as the max-logit kernels take them: ``(mask, is_causal)``.

    Args:
        attn_mask: the call's mask as SDPA takes it (None, boolean, or additive float).
        is_causal: the call's top-left causal rule.
        tq: query length.
        tk: key length.
        real_queries: ``(B, Tq)`` bool, True for a real token (None: every query is real).
        real_keys: ``(B, Tk)`` bool (None: every key is real).
        cu_seq_lens: ``(N + 1,)`` offsets of packed documents (None: no documents).

    Returns:
        Without token masks or documents, the call's own ``(attn_mask, is_causal)`` (a float
        mask is read with `allowed_pairs` by every kernel: nothing is materialised). With them, a
        boolean mask broadcastable to ``(B, H, Tq, Tk)`` (the causal rule written into it) and
        False. (The max-logit paths take packed documents one at a time instead,
        `muonclip.attention.documents`: this dense mask is the rule's definition.)
    """
    if real_queries is None and real_keys is None and cu_seq_lens is None:
        return attn_mask, is_causal
    if cu_seq_lens is not None:
        dq, dk = document_ids(cu_seq_lens, tq), document_ids(cu_seq_lens, tk)
        seen = (dq[:, None] == dk[None, :]) & (dq[:, None] >= 0)
        seen = _four_d(seen.tril() if is_causal else seen)
        if attn_mask is not None:
            seen = seen & _four_d(allowed_pairs(attn_mask))
    elif attn_mask is not None:
        seen = _four_d(allowed_pairs(attn_mask))
    else:
        seen = torch.ones(tq, tk, dtype=torch.bool, device=(real_queries if real_queries is not None
                                                              else real_keys).device)
        seen = _four_d(seen.tril() if is_causal else seen)
    if real_queries is not None:
        seen = seen & real_queries.to(torch.bool)[:, None, :, None]
    if real_keys is not None:
        seen = seen & real_keys.to(torch.bool)[:, None, None, :]
    return seen, False


__all__ = ["MASKED_AT", "allowed_pairs", "clip_pairs", "document_ids"]
