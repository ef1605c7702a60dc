"""Attention that also returns each query row's log-sum-exp (LSE), from SDPA's own kernel.

Fused attention kernels compute, per query row ``i`` of head ``h``, the natural-log
``lse_i = log sum_j exp(scale * q_i . k_j + b_ij)`` over the keys the row may see (``b`` the
additive mask). SDPA throws it away; the LSE gate (`muonclip.attention.gate`) bounds the max
logit with it.

Where it comes from (detected, never assumed: private ops change between torch releases):

* **CPU**: ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value,
  dropout_p, is_causal, *, attn_mask, scale) -> (output, logsumexp)``, the kernel that
  ``F.scaled_dot_product_attention`` itself runs on CPU when its dispatcher picks the flash
  backend. `sdpa_with_lse` uses it only when (1) the op exists with exactly that schema
  (argument names and two returns; `cpu_lse_op`), and (2) for this very call the dispatcher
  would pick that kernel (``torch._fused_sdp_choice`` returns the flash backend: float
  inputs, no dropout, 4-D tensors, ...). It then passes what SDPA passes: a boolean mask
  converted to an additive one (0 where allowed, ``-inf`` elsewhere) in the query's dtype.
  Same kernel, same inputs: the output and its gradients are those of
  ``F.scaled_dot_product_attention`` bit for bit (``tests/test_attention_gate.py`` checks it).
* **Anything else** (CUDA, an older or newer torch whose op differs, dropout, a call SDPA
  would run with its math backend): `sdpa_with_lse` returns None and the caller keeps the
  exact chunked max. On CUDA the exact max already comes fused from FlexAttention
  (``set_max_logit_backend("flex")``); a gate on CUDA's LSE would need a device-to-host read
  per call to know which heads to compute exactly, which this package does not do.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

_CPU_OP_ARGS = ("query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale")
_FLASH = 1  # torch.nn.attention.SDPBackend.FLASH_ATTENTION (the int _fused_sdp_choice returns)


def schema_matches(op: Any) -> bool:
    """Whether ``op`` (an ``OpOverloadPacket``) has the CPU flash schema this module calls:
    arguments ``(query, key, value, dropout_p, is_causal, *, attn_mask, scale)`` and two returns."""
    try:
        schema = op.default._schema
    except (AttributeError, RuntimeError):
        return False
    names = tuple(a.name for a in schema.arguments)
    kw_only = tuple(a.name for a in schema.arguments if a.kwarg_only)
    return names == _CPU_OP_ARGS and kw_only == ("attn_mask", "scale") and len(schema.returns) == 2


@lru_cache(maxsize=1)
def cpu_lse_op() -> Any | None:
    """The CPU flash-attention op returning ``(output, logsumexp)``, or None when this torch has
    no op of that name and schema (then the drop-in computes the exact max on every call)."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None or not schema_matches(op) or not hasattr(torch, "_fused_sdp_choice"):
        return None
    return op


def _sdpa_picks_flash(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> bool:
    try:
        choice = torch._fused_sdp_choice(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    except (TypeError, RuntimeError):  # an older signature, or inputs the dispatcher refuses
        return False
    return int(choice) == _FLASH


def sdpa_with_lse(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[Tensor, Tensor] | None:
    """``F.scaled_dot_product_attention``'s output and the kernel's LSE, or None where unavailable.

    Args: as ``F.scaled_dot_product_attention`` (``query (B, Hq, Tq, D)``, ``key (B, Hkv, Tk, D)``,
    ``value (B, Hkv, Tk, Dv)``; all defaults as there).

    Returns:
        ``(output (B, Hq, Tq, Dv), lse (B, Hq, Tq))``: the output is SDPA's (same kernel, same
        inputs, same autograd graph); ``lse`` is the natural-log LSE of each row's scaled,
        masked scores (a row with no allowed key holds a finite placeholder, e.g. 0, or
        ``finfo.min`` for an ``finfo.min`` mask). None when the call cannot run on that kernel
        (see the module docstring).
    """
    if query.device.type != "cpu" or query.ndim != 4:
        return None
    op = cpu_lse_op()
    if op is None or not _sdpa_picks_flash(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        return None
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # what SDPA does before its kernel
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill_(~attn_mask, -float("inf"))
    out, lse = op(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return out, lse


__all__ = ["cpu_lse_op", "schema_matches", "sdpa_with_lse"]
