"""Exact per-head max logits of an attention call, without materialising the full score matrix.

For query head h the max logit of one call is::

    S_h = max over batch b, query i, key j with (i, j) allowed of  scale * q[b, h, i] . k[b, g(h), j]

signed (not absolute), where ``g(h) = h // (Hq // Hkv)`` is the key head of query head h
(``enable_gqa``, as ``repeat_interleave``), and "allowed" is the pair rule of
`muonclip.attention.pairs`: ``j <= i`` when ``is_causal`` (torch's top-left causal mask),
``attn_mask[b, h, i, j]`` True for a boolean mask, above ``MASKED_AT`` (-1e4) for an additive
float mask (``-inf``, ``-1e9`` and every ``finfo(dtype).min`` mask; a finite value above it is
a bias, which is not part of ``q.k``: QK-Clip cannot scale it, so it is not included in the
max). Padding queries and keys come to these functions already folded into a boolean mask
(`muonclip.attention.call.AttentionCall.clip_pairs`). Fully masked rows contribute ``-inf``.

Two ways to get it:

* `chunked_max_logits` (any device; the reference): the scores in chunks of query rows, each
  chunk ``(B, Hq, chunk, Tk)`` float32 of at most ``DEFAULT_CHUNK_ELEMENTS`` elements
  (4 MiB, small enough to stay in cache), masked and reduced at once. With ``is_causal`` a
  chunk reads only the keys it can see, and only its diagonal block is masked. Costs about
  the causal ``Q K^T`` matmul of attention again.
* `flex_attention_with_max` (CUDA only, opt-in): PyTorch FlexAttention computes the output
  and, with ``return_aux=AuxRequest(max_scores=True)``, each query row's max score in the same
  fused kernel. torch 2.13 refuses ``max_scores`` on CPU; the tests run this wrapper (masks,
  causal rule, GQA, scale, reduction) on CPU through FlexAttention's dense reference
  implementation, and the fused kernel only where a GPU is present.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

from .call import check_shapes
from .pairs import allowed_pairs

DEFAULT_CHUNK_ELEMENTS = 1 << 20  # 1M float32 scores (4 MiB) per chunk: stays in cache


def _scores(qc: Tensor, kT: Tensor) -> Tensor:
    """``qc (B, Hkv, G, c, D) @ kT (B, Hkv, D, n) -> (B, Hkv, G, c, n)`` as one batched matmul.

    Folding the G query heads of a key head into the rows keeps the matmul a plain bmm over
    (B, Hkv); a broadcast over G would send torch.matmul down a much slower path.
    """
    B, hkv, G, c, D = qc.shape
    return torch.matmul(qc.reshape(B, hkv, G * c, D), kT).view(B, hkv, G, c, kT.shape[-1])


def _fold(out: Tensor, scores: Tensor, hq: int) -> Tensor:
    """Running max ``out (Hq,)`` with the per-head max of ``scores (B, Hkv, G, c, n)``."""
    if scores.numel() == 0:
        return out
    return torch.maximum(out, scores.amax(dim=(0, 3, 4)).reshape(hq).to(torch.float32))


@torch.no_grad()
def chunked_max_logits(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    chunk_size: int | None = None,
) -> Tensor:
    """Per-query-head max logit of one attention call (see module doc), chunked over queries.

    Args:
        query: ``(B, Hq, Tq, D)``.
        key: ``(B, Hkv, Tk, D)``; ``Hkv == Hq``, or ``Hq % Hkv == 0`` with ``enable_gqa``.
        attn_mask: None (default), or a bool / additive float mask broadcastable to
            ``(B, Hq, Tq, Tk)``, as for ``F.scaled_dot_product_attention``.
        is_causal: top-left causal mask, ``j <= i`` (default False).
        scale: softmax scale (default None: ``1 / sqrt(D)``).
        enable_gqa: query head h uses key head ``h // (Hq // Hkv)`` (default False).
        chunk_size: query rows per chunk (default None: as many as fit in
            ``DEFAULT_CHUNK_ELEMENTS`` scores).

    Returns:
        ``(Hq,)`` float32: the max over batch, queries and allowed keys; ``-inf`` for a head
        with no allowed pair.
    """
    hq, hkv = check_shapes(query, key, enable_gqa)
    B, _, Tq, D = query.shape
    Tk = key.shape[2]
    G = hq // hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    cdtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    k = key.detach().to(cdtype).transpose(-1, -2)  # (B, Hkv, D, Tk)
    allowed = None
    if attn_mask is not None:
        try:
            allowed = attn_mask.expand(B, hq, Tq, Tk).view(B, hkv, G, Tq, Tk)  # a view: no copy
        except RuntimeError:
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {(B, hq, Tq, Tk)}"
            ) from None
    if chunk_size is None:
        chunk_size = max(1, DEFAULT_CHUNK_ELEMENTS // max(1, B * hq * Tk))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    post_scale = scale > 0  # max(scale * x) = scale * max(x): scale the (Hq,) result, not the scores
    out = torch.full((hq,), -math.inf, dtype=torch.float32, device=query.device)
    for i0 in range(0, Tq, chunk_size):
        i1 = min(Tq, i0 + chunk_size)
        qc = query[:, :, i0:i1].detach().to(cdtype)
        if not post_scale:
            qc = qc.mul(scale)
        qc = qc.view(B, hkv, G, i1 - i0, D)
        if is_causal and allowed is None:
            # keys [0, i0) are visible to every row of the chunk: no mask to apply there;
            # only the diagonal block [i0, i1) needs the triangle.
            if i0 > 0:
                out = _fold(out, _scores(qc, k[..., : min(i0, Tk)]), hq)
            if i0 < Tk:
                j1 = min(Tk, i1)
                s = _scores(qc, k[..., i0:j1])  # (B, Hkv, G, c, j1 - i0)
                tri = torch.arange(j1 - i0, device=s.device)[None, :] > torch.arange(i1 - i0, device=s.device)[:, None]
                out = _fold(out, s.masked_fill_(tri, -math.inf), hq)
            continue
        n_keys = min(Tk, i1) if is_causal else Tk  # causal: rows < i1 only see keys < i1
        s = _scores(qc, k[..., :n_keys])  # (B, Hkv, G, c, n_keys)
        if is_causal:
            rows = torch.arange(i0, i1, device=s.device)[:, None]
            s.masked_fill_(torch.arange(n_keys, device=s.device)[None, :] > rows, -math.inf)
        if allowed is not None:
            s.masked_fill_(~allowed_pairs(allowed[..., i0:i1, :n_keys]), -math.inf)
        out = _fold(out, s, hq)
    return out * scale if post_scale else out


# ----------------------------------------------------------------------------------------------
# FlexAttention (CUDA)
# ----------------------------------------------------------------------------------------------


def flex_available(query: Tensor) -> bool:
    """True when FlexAttention with ``AuxRequest(max_scores=True)`` exists and ``query`` is on CUDA."""
    if not query.is_cuda:
        return False
    try:
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@lru_cache(maxsize=32)
def _causal_block_mask(Tq: int, Tk: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return create_block_mask(causal, None, None, Tq, Tk, device=device)


def flex_attention_with_max(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[Tensor, Tensor]:
    """FlexAttention output ``(B, Hq, Tq, Dv)`` and each query row's max logit ``(B, Hq, Tq)``
    (float32, detached) in one kernel (CUDA).

    Only ``attn_mask=None`` or a boolean mask (an additive float mask's bias would enter
    FlexAttention's ``max_scores``, so the caller uses `chunked_max_logits` for those), no
    dropout. Fully masked rows give output 0 (as torch 2.13's CPU SDPA does) and max
    ``-inf``. Tested on CPU through FlexAttention's dense reference implementation
    (``tests/test_attention_capture.py``); the fused CUDA kernel is tested only on a GPU.
    """
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    B, hq, Tq, _ = query.shape
    Tk = key.shape[2]
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise ValueError("flex_attention_with_max takes a boolean attn_mask only")
        mask = attn_mask.expand(B, hq, Tq, Tk)

        def mask_mod(b, h, q_idx, kv_idx):
            keep = mask[b, h, q_idx, kv_idx]
            return keep & (q_idx >= kv_idx) if is_causal else keep

        block_mask = create_block_mask(mask_mod, B, hq, Tq, Tk, device=str(query.device))
    elif is_causal:
        block_mask = _causal_block_mask(Tq, Tk, str(query.device))
    else:
        block_mask = None
    out, aux = _compiled_flex()(
        query, key, value, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
        return_aux=AuxRequest(max_scores=True),
    )
    return out, aux.max_scores.detach().float()
