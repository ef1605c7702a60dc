r"""The LSE gate: per-head max logits that are exact wherever QK-Clip could act, and nearly free.

**The bound.** For query row \(i\) of head \(h\), with scores \(s_{ij} = \text{scale}\, q_i \cdot
k_j\) and additive mask entries \(b_{ij}\) over the keys \(j\) the row may see, the kernel's
natural-log LSE satisfies \(\text{lse}_i \ge s_{ij} + b_{ij}\) for every such \(j\). With
\(c = \min(0, \min_{ij} b_{ij})\) over the allowed entries (those above ``MASKED_AT``, the pair
rule of `muonclip.attention.pairs`; 0 for a boolean mask, a causal rule or no mask),
\(s_{ij} \le \text{lse}_i - c\) for every pair the clip sees, so the head's max logit satisfies

\[
M_h \le B_h = \max_i \text{lse}_i - c, \qquad B_h \le M_h + \log n - c
\]

(\(n\) the most keys a row sees). A positive bias can only raise the LSE (the bound stays
valid); a negative one is paid for by \(c\). The max over \(i\) runs over the rows of real
queries only (`seen_rows`: a padding query's row may hold any LSE and carries no pair of the
max). Rows with no allowed key carry no score and may hold any value in the LSE (the CPU kernel
writes 0): they only loosen the bound.

**Rounding.** The kernel's scores and the exact path's (`chunked_max_logits`) are two float
computations of the same dot products in different orders. Each differs from the true
\(s_{ij}\) by at most \((D + 2)\, u\, |\text{scale}|\, \lVert q_i\rVert \lVert k_j\rVert\)
(Higham's bound for a length-\(D\) dot product plus the scaling; \(u\) the unit round-off of the
float32 accumulation both use, float64's for float64 inputs), and the LSE's own exp/sum/log adds
a few units of round-off of its value. So the gate adds

\[
\epsilon_h = (2D + 8)\, u\, |\text{scale}|\, D \max |q| \max |k| + 8\, u_\text{lse} (|B_h| + 1)
\]

(\(\lVert q_i\rVert \lVert k_j\rVert \le D \max|q| \max|k|\) over all elements of the call's q and
k: one min/max pass over each, cheaper than their row norms)

and \(B_h + \epsilon_h\) is an upper bound of the max the exact path would compute, whatever the
two kernels' summation orders.

**The gate.** Given the clip's threshold \(\tau\), a head with \(B_h + \epsilon_h \le \tau\)
cannot be clipped: it gets the value \(B_h + \epsilon_h\) (\(\le \tau\), flagged as a bound).
Every other head gets its exact max from `chunked_max_logits`, computed for those heads only.
Folded into a running max over micro-batches (and ranks), a head's value is then either
\(\le \tau\) (no clip: the exact decision) or above it, and then it is the exact maximum, since
every bound is \(\le \tau\): the decision and \(\gamma_h = \tau / S_h\) are those of the exact
path. A NaN anywhere in the bound sends the head to the exact path.

**Computing only the flagged heads.** On CPU (no device sync to fear) the flagged heads are
picked out by index and their exact max computed by `chunked_max_logits` on those heads alone.
On a GPU, reading flags on the host would stall the stream at every attention call, so the gate
runs inside `muonclip.attention._triton_max_logits`'s kernel, per program (a block of 64 query
rows of one head and batch element): the same bound over that block's rows (with that block's
``max|q|``), the bound stored where it is ``<= tau``, the exact max of the block otherwise; a
head's value is the max over its programs. Above tau it is the exact max (every stored bound is
``<= tau`` and ``>=`` its block's exact max); at or below tau no clip is due, exactly as on the
exact path. Without Triton (or for a call it does not take: float64, head dim > 256) every
head is computed exactly and nothing is flagged.

**Packed documents** (a call with ``cu_seq_lens``, a varlen kernel): the same gate (`gate`,
which takes the way the exact maxima of chosen heads are computed), with the bound over the
whole packed row (each row's LSE covers exactly the keys of its document, so ``max_i lse_i``
bounds the max over every document's pairs) and the exact max of the heads above the threshold
computed document by document (`muonclip.attention.documents`). On a GPU, choosing those heads
reads the flags on the host: one host sync per recorded call (the per-block gate inside the
Triton kernel, which avoids it for ordinary calls, has no document boundaries).

Cost: a max over the LSE ``(B, H, Tq)``, a min/max pass over q and over k, and a min over the finite
entries of an additive mask; plus the exact max of the flagged heads (none, in most steps).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from . import _triton_max_logits as triton_max
from ._max_logits import chunked_max_logits
from .call import AttentionCall
from .documents import document_max_logits
from .pairs import allowed_pairs


def _roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps / 2


def _max_abs(x: Tensor) -> Tensor:
    """``max |x|`` over the whole tensor, as a float32 scalar (one min/max pass, no temporary)."""
    lo, hi = x.detach().aminmax()
    return torch.maximum(hi, -lo).to(torch.float32)


def bias_floor(attn_mask: Tensor | None) -> Tensor | float:
    """``c = min(0, min over allowed entries of an additive mask)`` (entries above ``MASKED_AT``:
    `muonclip.attention.pairs`); 0 for no mask or a bool mask."""
    if attn_mask is None or attn_mask.dtype == torch.bool:
        return 0.0
    allowed = allowed_pairs(attn_mask)
    return torch.where(allowed, attn_mask, 0.0).amin().clamp(max=0.0).to(torch.float32)


def margins(head_dim: int, dtype: torch.dtype, scale: float,
            lse_dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """The two round-off allowances of the bound (module docstring): ``eps_h = dot * max|q| max|k|
    + lse * (|B_h| + 1)`` with ``dot = (2D + 8) D u |scale|`` (``u`` the unit round-off of the
    accumulation) and ``lse = 8 u_lse``. Returns ``(dot, lse)``."""
    return (2 * head_dim + 8) * head_dim * _roundoff(dtype) * abs(scale), 4 * torch.finfo(lse_dtype).eps


def seen_rows(call: AttentionCall, lse: Tensor) -> Tensor:
    """The LSE ``(B, Hq, Tq)`` with the rows of queries the clip does not see (padding,
    ``call.real_queries`` False) at ``-inf``: they carry no pair of the max, so they must not
    loosen its bound."""
    if call.real_queries is None:
        return lse
    return lse.masked_fill(~call.real_queries.to(torch.bool)[:, None, :], -math.inf)


@torch.no_grad()
def lse_bound(call: AttentionCall, lse: Tensor) -> Tensor:
    """Per query head, ``B_h + eps_h`` (module docstring): an upper bound of the head's max
    logit as `chunked_max_logits` computes it over the pairs the clip sees.

    Args:
        call: the attention call (`AttentionCall`).
        lse: ``(B, Hq, Tq)`` natural-log LSE of the call's scaled, masked scores (`sdpa_with_lse`).

    Returns:
        ``(Hq,)`` float32; NaN or ``+inf`` where no bound could be made.
    """
    query, key = call.query, call.key
    hq, hkv = call.heads()
    D = query.shape[-1]
    scale = call.softmax_scale
    if lse.numel() == 0:
        return torch.full((hq,), -math.inf, device=query.device)
    # (B, Hq, Tq) -> (B * Tq, Hq) rows: the CPU kernel stores the LSE as (B, Tq, Hq), where this is a view;
    # an amax over dims (0, 2) of that layout runs a far slower reduction
    row_max = seen_rows(call, lse.detach()).movedim(1, -1).reshape(-1, hq).amax(dim=0)
    bound = row_max.to(torch.float32) - bias_floor(call.attn_mask)
    # |q_i||k_j| <= D max|q| max|k|: one cheap pass over q and k instead of their row norms
    dot, own = margins(D, query.dtype, scale, lse.dtype)
    return bound + dot * _max_abs(query) * _max_abs(key) + own * (bound.abs() + 1)


def _head_slice(attn_mask: Tensor | None, idx: Tensor) -> Tensor | None:
    """The mask rows of query heads ``idx``: indexed only when the mask has a head dimension."""
    if attn_mask is None:
        return None
    m = attn_mask.reshape((1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape)) if attn_mask.ndim < 4 else attn_mask
    return m if m.shape[1] == 1 else m.index_select(1, idx)


@torch.no_grad()
def gated_max_logits(call: AttentionCall, lse: Tensor, threshold: float) -> tuple[Tensor, Tensor]:
    """Per-head max logits, exact for every head that could exceed ``threshold`` (module docstring).

    Args:
        call: the attention call (`AttentionCall`): the pairs the clip sees are its
            `AttentionCall.clip_pairs`.
        lse: ``(B, Hq, Tq)`` the kernel's LSE for this call (`sdpa_with_lse`).
        threshold: the clip's tau (> 0).

    Returns:
        ``(values, is_bound)``, each ``(Hq,)``: ``values`` float32, the exact max (as
        `chunked_max_logits` gives it) where ``is_bound`` is False, else an upper bound of it
        that is ``<= threshold``.
    """
    if call.cu_seq_lens is not None:  # packed documents: the exact maxima one document at a time
        return gate(call, lse, threshold, lambda heads: document_max_logits(call, heads), host_read=True)
    if triton_max.usable(call.query, call.key, call.scale):  # GPU: the gate runs inside the kernel, per block of rows
        mask, is_causal = call.clip_pairs()
        dot, own = margins(call.query.shape[-1], call.query.dtype, call.softmax_scale, lse.dtype)
        return triton_max.triton_gated_max_logits(
            call.query, call.key, seen_rows(call, lse.detach()), threshold, mask, is_causal, call.scale,
            call.enable_gqa, bias_floor=bias_floor(call.attn_mask), dot_margin=dot, lse_margin=own,
        )
    return gate(call, lse, threshold, lambda heads: _chunked_on(call, heads), host_read=False)


def gate(call: AttentionCall, lse: Tensor, threshold: float, exact_on: Callable[[Tensor | None], Tensor], *,
         host_read: bool) -> tuple[Tensor, Tensor]:
    """The LSE gate (module docstring) over any way of computing exact maxima.

    Every head gets its bound `lse_bound`; a head whose bound is at or below ``threshold`` keeps
    it (flagged), every other head gets ``exact_on(heads)``: the exact maxima of the query heads
    ``heads`` (a 1-D index tensor; None: every head, in order). On CPU only the heads above the
    threshold are computed. Off the CPU, choosing heads reads the flags on the host: with
    ``host_read`` False every head is computed exactly and none is flagged (no sync); with
    ``host_read`` True (packed documents, whose exact max is a loop over documents) one read,
    then only the heads above the threshold.

    Returns:
        ``(values, is_bound)``, each ``(Hq,)``, as `gated_max_logits`.
    """
    bound = lse_bound(call, lse)
    is_bound = bound <= threshold  # False for NaN: such a head takes the exact path
    if call.query.device.type != "cpu":
        if not host_read:
            return exact_on(None), torch.zeros_like(is_bound)
        if bool(is_bound.all()):  # one host read
            return bound, is_bound
    flagged = (~is_bound).nonzero().flatten()
    if flagged.numel() == 0:
        return bound, is_bound
    return bound.index_put((flagged,), exact_on(flagged)), is_bound


def _chunked_on(call: AttentionCall, heads: Tensor | None) -> Tensor:
    """`chunked_max_logits` of the query heads ``heads`` of an ordinary call (None or all: the whole call)."""
    mask, is_causal = call.clip_pairs()
    hq, hkv = call.heads()
    if heads is None or heads.numel() == hq:
        return chunked_max_logits(call.query, call.key, mask, is_causal, call.scale, call.enable_gqa)
    return chunked_max_logits(call.query.index_select(1, heads), call.key.index_select(1, heads // (hq // hkv)),
                              _head_slice(mask, heads), is_causal, call.scale)


@torch.no_grad()
def exact_max_logits(call: AttentionCall) -> Tensor:
    """Every head's exact max logit over the pairs the clip sees (``(Hq,)`` float32, as
    `chunked_max_logits`), on the fastest path the call can take:
    `muonclip.attention._triton_max_logits` where it runs (a CUDA GPU with Triton),
    `chunked_max_logits` elsewhere; one packed document at a time for a call with documents
    (`muonclip.attention.documents`)."""
    if call.cu_seq_lens is not None:
        return document_max_logits(call)
    mask, is_causal = call.clip_pairs()
    if triton_max.usable(call.query, call.key, call.scale):
        return triton_max.triton_max_logits(call.query, call.key, mask, is_causal, call.scale, call.enable_gqa)
    return chunked_max_logits(call.query, call.key, mask, is_causal, call.scale, call.enable_gqa)
