r"""Attention with learned sinks (GPT-OSS's ``sinks``, transformers' ``s_aux``), fused.

A sink is one learned logit \(a_h\) per query head that joins every row's softmax denominator and
carries no value:

\[
o_i = \frac{\sum_j e^{s_{ij}} v_j}{\sum_j e^{s_{ij}} + e^{a_h}}
    = \Big(\sum_j p_{ij} v_j\Big) \cdot \frac{e^{\text{lse}_i}}{e^{\text{lse}_i} + e^{a_h}}
    = o^{\text{SDPA}}_i \cdot \sigma(\text{lse}_i - a_h),
\]

with \(s_{ij}\) the scaled, masked scores, \(p_{ij}\) their softmax and \(\text{lse}_i\) the
row's log-sum-exp over the keys (no sink). That is what transformers' eager attention of every
sink model computes (the sink concatenated as one more column of the scores, softmax, the column
dropped). Two ways to get it here, both exact:

* **The kernel's LSE** (CPU, where `muonclip.attention._lse` finds the flash kernel and its
  backward op with the expected schemas): one fused SDPA call returns \(o^{\text{SDPA}}\) and
  \(\text{lse}\); the output is multiplied by the per-row factor \(\sigma(\text{lse}_i - a_h)\).
  The kernel's LSE is not differentiable in torch, so the backward is stated here: with
  \(o' = o\,\sigma\) and upstream gradient \(g\), the gradient of the scores is
  \(p'_{ij}(g_i \cdot v_j - g_i \cdot o'_i)\), which is the kernel's own backward called with
  the gradient \(\sigma_i g_i\) and the output \(o'\) (the kernel recomputes \(p_{ij}\) from
  the LSE and uses the output only for \(g_i \cdot o_i\)); and
  \(\partial L / \partial a_h = -\sum_{b,i} (g_i \cdot o'_i)(1 - \sigma_i)\). The same LSE feeds
  the max-logit gate (`muonclip.attention._gate`), since it is the LSE of the q·k scores alone.
* **One more key** (any other device, dropout, a mask that needs a gradient, a torch without the
  ops, inside ``torch.compile``): the sink is a key every query sees, with a zero value and a logit \(a_h\):
  ``q' = [q, a_h / scale]``, ``k' = [k, 0]`` plus the key ``[0, ..., 0, 1]``, ``v'`` plus a zero
  row, the mask widened by one allowed column (the causal rule written out as a mask). One
  ``F.scaled_dot_product_attention`` call, on any backend, with autograd's own gradients;
  the sink's logit is ``scale * (a_h / scale)``, equal to \(a_h\) within one rounding of the
  query's dtype.

The sink is not a product of \(W_q\) and \(W_k\): QK-Clip cannot scale it and the recorded max
logit is over the q·k scores only.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ._lse import additive_mask, cpu_lse_op, schema_matches, sdpa_choice
from .call import AttentionCall

_FLASH = 1
_CPU_BACKWARD = ("_scaled_dot_product_flash_attention_for_cpu_backward",
                 ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal", "attn_mask",
                  "scale"), ("attn_mask", "scale"), 3)


@lru_cache(maxsize=1)
def cpu_lse_backward_op() -> Any | None:
    """The backward op of the CPU flash kernel, ``(grad_out, query, key, value, out, logsumexp,
    dropout_p, is_causal, *, attn_mask, scale) -> (grad_query, grad_key, grad_value)``, or None when
    this torch has no op of that name and schema."""
    op = getattr(torch.ops.aten, _CPU_BACKWARD[0], None)
    return op if op is not None and schema_matches(op, _CPU_BACKWARD) else None


class _SinkFlashCPU(torch.autograd.Function):
    """``o * sigmoid(lse - sinks)`` from the CPU flash kernel, with the backward of the module docstring."""

    @staticmethod
    def forward(ctx, query, key, value, sinks, bias, is_causal, scale):  # noqa: D401 - autograd API
        out, lse = cpu_lse_op()(query, key, value, 0.0, is_causal, attn_mask=bias, scale=scale)[:2]
        factor = torch.sigmoid(lse - sinks.detach().to(lse.dtype).view(1, -1, 1))  # (B, Hq, Tq) float32
        out_s = out * factor.unsqueeze(-1).to(out.dtype)
        ctx.save_for_backward(query, key, value, out_s, lse, factor, bias)
        ctx.is_causal, ctx.scale, ctx.sink_dtype = is_causal, scale, sinks.dtype
        ctx.mark_non_differentiable(lse)
        return out_s, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        query, key, value, out_s, lse, factor, bias = ctx.saved_tensors
        g = (grad_out * factor.unsqueeze(-1).to(grad_out.dtype)).contiguous()
        dq, dk, dv = cpu_lse_backward_op()(g, query, key, value, out_s, lse, 0.0, ctx.is_causal, attn_mask=bias,
                                           scale=ctx.scale)
        row = (grad_out.float() * out_s.float()).sum(-1)  # (B, Hq, Tq): g_i . o'_i
        d_sinks = -(row * (1.0 - factor)).sum(dim=(0, 2)).to(ctx.sink_dtype)
        return dq, dk, dv, d_sinks, None, None, None


def _fused_lse_path(call: AttentionCall) -> bool:
    """Whether this call can take the kernel's-LSE path (module docstring)."""
    return (
        call.query.device.type == "cpu"
        and not torch.compiler.is_compiling()  # private ops and their schemas: kept out of compiled graphs
        and call.query.ndim == 4
        and call.dropout_p == 0.0
        and not (call.attn_mask is not None and call.attn_mask.requires_grad)
        and cpu_lse_op() is not None
        and cpu_lse_backward_op() is not None
        and sdpa_choice(call) == _FLASH
    )


def _with_sink_key(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(q', k', v', mask')`` of the one-more-key form (module docstring)."""
    query, key, value, attn_mask, scale = call.query, call.key, call.value, call.attn_mask, call.softmax_scale
    B, hq, tq, _ = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    col = (call.sinks.to(query.dtype) / scale).view(1, hq, 1, 1).expand(B, hq, tq, 1)
    q2 = torch.cat([query, col], dim=-1)
    sink_key = torch.zeros(B, hkv, 1, key.shape[-1] + 1, dtype=key.dtype, device=key.device)
    sink_key[..., -1] = 1.0
    k2 = torch.cat([F.pad(key, (0, 1)), sink_key], dim=2)  # every key with a zero last entry, then the sink
    v2 = F.pad(value, (0, 0, 0, 1))  # the sink's value: zeros
    if attn_mask is None:
        allowed = torch.ones(tq, tk, dtype=torch.bool, device=query.device)
        mask = allowed.tril() if call.is_causal else allowed
    elif call.is_causal:  # SDPA applies both: write the causal rule into the mask
        tri = torch.ones(tq, tk, dtype=torch.bool, device=query.device).tril()
        mask = attn_mask & tri if attn_mask.dtype == torch.bool else attn_mask.masked_fill(~tri, -math.inf)
    else:
        mask = attn_mask
    mask = mask.expand(*mask.shape[:-2], tq, tk) if mask.ndim >= 2 else mask.expand(tq, tk)
    extra = torch.ones if mask.dtype == torch.bool else torch.zeros
    mask2 = torch.cat([mask, extra(*mask.shape[:-1], 1, dtype=mask.dtype, device=mask.device)], dim=-1)
    return q2, k2, v2, mask2


def attention_with_sinks(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    """`sink_attention` of an `AttentionCall` (its ``sinks`` must be set): ``(output, lse or None)``."""
    sinks, query = call.sinks, call.query
    if sinks is None or sinks.shape != (query.shape[1],):
        raise ValueError(f"sinks must hold one logit per query head, shape ({query.shape[1]},), "
                         f"got {None if sinks is None else tuple(sinks.shape)}")
    if _fused_lse_path(call):
        bias = additive_mask(call.attn_mask, query.dtype)
        return _SinkFlashCPU.apply(query, call.key, call.value, sinks, bias, call.is_causal, call.scale)
    q2, k2, v2, mask2 = _with_sink_key(call)
    out = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask2, dropout_p=call.dropout_p,
                                         scale=call.softmax_scale, enable_gqa=call.enable_gqa)
    return out, None


def sink_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    sinks: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Scaled dot-product attention whose softmax denominator also holds one sink logit per query head.

    Args:
        query: ``(B, Hq, Tq, D)``.
        key: ``(B, Hkv, Tk, D)``.
        value: ``(B, Hkv, Tk, Dv)``.
        sinks: ``(Hq,)`` the sink logits (a learned parameter: its gradient is computed).
        attn_mask: None (default), a boolean mask (True = attend) or an additive float mask,
            broadcastable to ``(B, Hq, Tq, Tk)``.
        dropout_p: attention dropout probability (default 0.0), on the weights of the real keys.
        is_causal: top-left causal mask (default False).
        scale: softmax scale (default None: ``1 / sqrt(D)``).
        enable_gqa: key/value heads shared by ``Hq // Hkv`` consecutive query heads (default False).

    Returns:
        ``(output (B, Hq, Tq, Dv), lse)``: the output is the module docstring's \\(o\\), equal to
        transformers' eager sink attention; ``lse`` is the kernel's ``(B, Hq, Tq)`` float32
        log-sum-exp of the q·k scores (without the sink) where the fused CPU path ran, else None.
    """
    return attention_with_sinks(AttentionCall(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                              sinks=sinks))


__all__ = ["attention_with_sinks", "cpu_lse_backward_op", "sink_attention"]
